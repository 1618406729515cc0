//! Status codes shared by the wire protocol and the C ABI (README.md, "C ABI conventions").
//! Numbers are never reused: a retired code stays reserved.

/// Outcome of one operation. Positive codes mean "not served: recompute";
/// negative codes mean the caller erred or the library has a bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Status {
    Ok = 0,
    Miss = 1,
    Mismatch = 2,
    Corrupt = 3,
    TooSmall = 4,
    Unavailable = 5,
    Timeout = 6,
    Rejected = 7,
    /// Wire only: the request was malformed (the C ABI maps it to EINVAL).
    BadRequest = 8,
    /// Wire only: the node hit an internal error.
    Internal = 9,
    Einval = -1,
    Einternal = -2,
    /// Missing or wrong auth token (C ABI only: refused at the hello or by
    /// the MDS; a misconfiguration, never a miss).
    Edenied = -3,
}

impl Status {
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The status a wire byte carries; unknown bytes read as `Internal`.
    pub fn from_wire(b: u8) -> Status {
        match b {
            0 => Status::Ok,
            1 => Status::Miss,
            2 => Status::Mismatch,
            3 => Status::Corrupt,
            4 => Status::TooSmall,
            5 => Status::Unavailable,
            6 => Status::Timeout,
            7 => Status::Rejected,
            8 => Status::BadRequest,
            _ => Status::Internal,
        }
    }

    /// The wire byte for this status (negative codes travel as `Internal`).
    pub fn to_wire(self) -> u8 {
        match self {
            Status::Einval => Status::BadRequest as u8,
            Status::Einternal | Status::Edenied => Status::Internal as u8,
            s => s as i32 as u8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Miss => "miss",
            Status::Mismatch => "mismatch",
            Status::Corrupt => "corrupt",
            Status::TooSmall => "too_small",
            Status::Unavailable => "unavailable",
            Status::Timeout => "timeout",
            Status::Rejected => "rejected",
            Status::BadRequest => "bad_request",
            Status::Internal => "internal",
            Status::Einval => "einval",
            Status::Einternal => "einternal",
            Status::Edenied => "edenied",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_round_trip() {
        for b in 0u8..=9 {
            assert_eq!(Status::from_wire(b).to_wire(), b);
        }
        assert_eq!(Status::from_wire(200), Status::Internal);
        assert_eq!(Status::Rejected.code(), 7);
        assert_eq!(Status::Einval.code(), -1);
    }
}
