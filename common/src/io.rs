//! Socket writes shared by the node and the client.

use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Writes every byte of `parts`, in order, with vectored writes (one system
/// call for all of them when the socket takes them; the kernel takes at
/// most IOV_MAX slices a call, and the rest go in the next), skipping
/// empty parts.
pub async fn write_all_parts<W: AsyncWrite + Unpin>(w: &mut W, parts: &[&[u8]]) -> std::io::Result<()> {
    if let [one] = parts {
        return w.write_all(one).await;
    }
    let mut slices: Vec<std::io::IoSlice<'_>> =
        parts.iter().filter(|p| !p.is_empty()).map(|p| std::io::IoSlice::new(p)).collect();
    let mut rest: &mut [std::io::IoSlice<'_>] = &mut slices;
    while !rest.is_empty() {
        let n = w.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_part_arrives_in_order_and_empty_ones_are_skipped() {
        let (mut a, mut b) = tokio::io::duplex(7);
        let parts: [&[u8]; 4] = [b"head", b"", b"body-bytes", b"!"];
        let writer = tokio::spawn(async move { write_all_parts(&mut a, &parts).await });
        let mut got = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut b, &mut got).await.unwrap();
        writer.await.unwrap().unwrap();
        assert_eq!(got, b"headbody-bytes!");
    }
}
