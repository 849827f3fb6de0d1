//! The examples' command lines, on any host (no device needed): every example answers `--help`
//! and `-h` with its usage and exit code 0; a command line it does not take, or an error once
//! running, gets a one-line `error: ...` on stderr and a non-zero exit code, with no backtrace
//! unless `RUST_BACKTRACE` asks for one.

use std::process::{Command, Output};

const EXAMPLES: [(&str, &str); 13] = [
    ("broker", env!("CARGO_BIN_EXE_broker")),
    ("collector", env!("CARGO_BIN_EXE_collector")),
    ("dispatcher", env!("CARGO_BIN_EXE_dispatcher")),
    ("epoll_hub", env!("CARGO_BIN_EXE_epoll_hub")),
    ("mesh", env!("CARGO_BIN_EXE_mesh")),
    ("rc_pingpong", env!("CARGO_BIN_EXE_rc_pingpong")),
    ("reqresp", env!("CARGO_BIN_EXE_reqresp")),
    ("request_response", env!("CARGO_BIN_EXE_request_response")),
    ("stream", env!("CARGO_BIN_EXE_stream")),
    ("telemetry", env!("CARGO_BIN_EXE_telemetry")),
    ("tokio_server", env!("CARGO_BIN_EXE_tokio_server")),
    ("two_hosts", env!("CARGO_BIN_EXE_two_hosts")),
    ("verbs_loopback", env!("CARGO_BIN_EXE_verbs_loopback")),
];

fn bin(name: &str) -> &'static str {
    EXAMPLES
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no example {name}"))
        .1
}

/// Runs `name` with `args`, `RUST_BACKTRACE` set to `backtrace` (unset if `None`) and
/// `RUST_LIB_BACKTRACE` unset.
fn run_with(name: &str, args: &[&str], backtrace: Option<&str>) -> Output {
    let mut cmd = Command::new(bin(name));
    cmd.args(args).env_remove("RUST_LIB_BACKTRACE");
    match backtrace {
        Some(v) => cmd.env("RUST_BACKTRACE", v),
        None => cmd.env_remove("RUST_BACKTRACE"),
    };
    cmd.output()
        .unwrap_or_else(|e| panic!("running {name}: {e}"))
}

fn run(name: &str, args: &[&str]) -> Output {
    run_with(name, args, None)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The output asks for help and exits 0, with the usage on stdout.
fn assert_help(out: &Output, what: &str) {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{what}: {}\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("Usage"), "{what}: no usage:\n{stdout}");
    assert!(stderr.is_empty(), "{what}: stderr:\n{stderr}");
}

/// The output is a failure: a non-zero exit code, one `error:` line on stderr (clap may list
/// missing arguments and the usage below it) and `says` in it, no backtrace.
fn assert_one_line_error(out: &Output, what: &str, says: &str) {
    let stderr = text(&out.stderr);
    assert!(
        !out.status.success() && out.status.code().is_some(),
        "{what}: {}\n{stderr}",
        out.status
    );
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "{what}: not one error line:\n{stderr}");
    assert!(
        errors[0].starts_with("error: ") && stderr.contains(says),
        "{what}: does not say {says:?}:\n{stderr}"
    );
    assert!(
        !stderr.to_lowercase().contains("backtrace"),
        "{what}: a backtrace:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{what}: a panic:\n{stderr}");
}

#[test]
fn every_example_answers_help() {
    for (name, _) in EXAMPLES {
        for flag in ["--help", "-h"] {
            assert_help(&run(name, &[flag]), &format!("{name} {flag}"));
        }
    }
}

#[test]
fn roles_answer_help() {
    for args in [
        &["collector", "serve"][..],
        &["collector", "sensors"],
        &["reqresp", "server"],
        &["reqresp", "clients"],
        &["stream", "recv"],
        &["stream", "send"],
    ] {
        let mut with_help = args[1..].to_vec();
        with_help.push("--help");
        let what = format!("{} {}", args[0], with_help.join(" "));
        let out = run(args[0], &with_help);
        assert_help(&out, &what);
        let stdout = text(&out.stdout);
        assert!(
            stdout.contains(&format!("{} {}", args[0], args[1])),
            "{what}: not the role's usage:\n{stdout}"
        );
    }
}

#[test]
fn an_unknown_argument_is_one_line_without_a_backtrace() {
    for backtrace in [None, Some("0")] {
        let out = run_with("collector", &["--bogus"], backtrace);
        let what = format!("collector --bogus (RUST_BACKTRACE {backtrace:?})");
        assert_one_line_error(&out, &what, "--bogus");
        let first = text(&out.stderr).lines().next().map(str::to_owned);
        assert_eq!(
            first.as_deref(),
            Some("error: unexpected argument '--bogus' found"),
            "{what}"
        );
        assert!(out.stdout.is_empty(), "{what}: {}", text(&out.stdout));
    }
    for (name, args, says) in [
        ("collector", &["--sensors", "0"][..], "--sensors"),
        ("collector", &["serve"], "--listen"),
        ("rc_pingpong", &["-m", "1000"], "bad MTU 1000"),
        ("telemetry", &["--arm", "sometimes"], "sometimes"),
        ("stream", &["send", "a:1", "ten", "64"], "ten"),
        ("two_hosts", &["both"], "both"),
        ("dispatcher", &["extra"], "extra"),
        (
            "broker",
            &["--serve", "127.0.0.1:1", "--publish", "127.0.0.1:1"],
            "--publish",
        ),
        // Checked before the device is opened: a fast subscriber's queue must hold its topic.
        ("broker", &["--queue", "100"], "--queue 100"),
    ] {
        let what = format!("{name} {args:?}");
        assert_one_line_error(&run(name, args), &what, says);
    }
}

/// An error returned once running (a check of the arguments after parsing: no device is
/// opened) goes through `rdmsg_examples::run`: one line, exit code 1.
#[test]
fn a_failure_is_one_line_without_a_backtrace() {
    let args = ["--id", "3", "--hosts", "127.0.0.1:1,127.0.0.1:2"];
    for backtrace in [None, Some("0")] {
        let out = run_with("mesh", &args, backtrace);
        let what = format!("mesh {args:?} (RUST_BACKTRACE {backtrace:?})");
        assert_one_line_error(
            &out,
            &what,
            "--id must be between 1 and the number of hosts",
        );
        assert_eq!(out.status.code(), Some(1), "{what}");
        assert_eq!(text(&out.stderr).lines().count(), 1, "{what}");
    }
    // Asked for, the report may say more (a backtrace), but the error comes first.
    let out = run_with("mesh", &args, Some("1"));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).starts_with("error: --id must be between"),
        "{}",
        text(&out.stderr)
    );
}
