//! Small helpers the binaries share for what users see on the command line.

/// Turns a multi-line argument-parser error (message, tips, usage block) into
/// the single line a daemon or tool prints: `PROG: error: MESSAGE (see PROG --help)`.
pub fn usage_error_line(prog: &str, parser_text: &str) -> String {
    let para: Vec<&str> = parser_text.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
    let joined = para.join(" ");
    let msg = joined.trim_start_matches("error: ");
    format!("{prog}: error: {msg} (see {prog} --help)")
}

/// The message a panic carries (its `&str` or `String` payload; empty for
/// any other), for the binaries' panic hooks.
pub fn panic_message<'a>(info: &'a std::panic::PanicHookInfo<'_>) -> &'a str {
    let p = info.payload();
    p.downcast_ref::<String>().map(String::as_str).or_else(|| p.downcast_ref::<&str>().copied()).unwrap_or("")
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

/// The man pages of `cmd`: `NAME.1` for the command and `NAME-SUB.1` for
/// each visible subcommand, rendered from the same definitions as `--help`.
#[cfg(feature = "man")]
pub fn man_pages(cmd: &clap::Command) -> Vec<(String, Vec<u8>)> {
    fn render(cmd: clap::Command) -> Vec<u8> {
        let mut out = Vec::new();
        // Writing into a Vec cannot fail.
        let _ = clap_mangen::Man::new(cmd).render(&mut out);
        out
    }
    let mut cmd = cmd.clone();
    cmd.build();
    let name = cmd.get_name().to_string();
    let mut pages = vec![(format!("{name}.1"), render(cmd.clone()))];
    for sub in cmd.get_subcommands() {
        if sub.is_hide_set() || sub.get_name() == "help" {
            continue;
        }
        let full = format!("{name}-{}", sub.get_name());
        let sub = sub.clone().name(full.clone()).bin_name(format!("{name} {}", sub.get_name()));
        pages.push((format!("{full}.1"), render(sub)));
    }
    pages
}

/// Each binary's one test of its command line: every argument has a help
/// line, the help has examples, and the man pages under `packaging/man`
/// (shipped in the packages) are what `man_pages` renders now. With
/// KVCELLAR_UPDATE_MAN=1 in the environment it writes the pages instead.
#[cfg(feature = "man")]
pub fn check_command_line(cmd: &clap::Command) {
    assert_documented(cmd);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/man");
    check_man_pages(cmd, &dir);
}

#[cfg(feature = "man")]
fn check_man_pages(cmd: &clap::Command, dir: &std::path::Path) {
    let update = std::env::var_os("KVCELLAR_UPDATE_MAN").is_some();
    let mut stale = Vec::new();
    for (file, text) in man_pages(cmd) {
        let path = dir.join(&file);
        if update {
            std::fs::create_dir_all(dir).expect("create the man page directory");
            std::fs::write(&path, &text).expect("write a man page");
        } else if std::fs::read(&path).ok().as_deref() != Some(&text[..]) {
            stale.push(file);
        }
    }
    assert!(
        stale.is_empty(),
        "man pages out of date with the command line: {stale:?}; regenerate with \
         KVCELLAR_UPDATE_MAN=1 cargo test -p {} the_man_pages_match",
        cmd.get_name()
    );
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
