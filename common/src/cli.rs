//! Small helpers the binaries share for what users see on the command line.

/// Turns a multi-line argument-parser error (message, tips, usage block) into
/// the single line a daemon or tool prints: `PROG: error: MESSAGE (see PROG --help)`.
pub fn usage_error_line(prog: &str, parser_text: &str) -> String {
    let para: Vec<&str> = parser_text.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
    let joined = para.join(" ");
    let msg = joined.trim_start_matches("error: ");
    format!("{prog}: error: {msg} (see {prog} --help)")
}

/// Parses the command line: Ok with the arguments, or Err with the exit
/// code after printing what was asked (`--help`, `--version`: exit 0) or the
/// one-line usage error (exit 2).
#[cfg(feature = "clap")]
pub fn parse_args<T: clap::Parser>(prog: &str) -> Result<T, std::process::ExitCode> {
    match T::try_parse() {
        Ok(c) => Ok(c),
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            Err(std::process::ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("{}", usage_error_line(prog, &e.to_string()));
            Err(std::process::ExitCode::from(2))
        }
    }
}

/// Every argument of `cmd` and its subcommands that has no help line
/// (`PATH --flag`), for the binaries' tests: an operator must never meet a
/// flag the help does not explain. A command without examples is listed too.
#[cfg(feature = "clap")]
pub fn undocumented(cmd: &clap::Command) -> Vec<String> {
    fn walk(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for a in cmd.get_arguments() {
            let id = a.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            if a.get_help().is_none() && a.get_long_help().is_none() {
                out.push(format!("{path} {id}"));
            }
        }
        for sub in cmd.get_subcommands() {
            if sub.get_name() == "help" {
                continue;
            }
            if sub.get_about().is_none() {
                out.push(format!("{path} {} (no about line)", sub.get_name()));
            }
            walk(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }
    let mut out = Vec::new();
    if cmd.get_after_help().is_none() {
        out.push(format!("{} (no examples after the help)", cmd.get_name()));
    }
    walk(cmd, cmd.get_name(), &mut out);
    out
}

/// Panics, listing them, when any argument of `cmd` lacks a help line
/// (each binary's test of its own command line).
#[cfg(feature = "clap")]
pub fn assert_documented(cmd: &clap::Command) {
    let missing = undocumented(cmd);
    assert!(missing.is_empty(), "no help line: {missing:?}");
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_line() {
        let text = "error: the following required arguments were not provided:\n  --node <NODE>\n  <KEY>\n\nUsage: kvctl get\n\nFor more information, try '--help'.\n";
        assert_eq!(
            super::usage_error_line("kvctl", text),
            "kvctl: error: the following required arguments were not provided: --node <NODE> <KEY> (see kvctl --help)"
        );
    }
}
