//! The xtask binary's command-line contract: usage errors exit with 2, help with 0.

use std::process::Command;

fn xtask(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .output()
        .expect("running xtask")
}

#[test]
fn an_unknown_task_prints_usage_and_exits_2() {
    for args in [
        &["no-such-task"][..],
        &[],
        &["vm", "--kernel", "2.6"],
        &["vm", "--env", "1X=2", "--", "true"],
    ] {
        let out = xtask(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("usage: cargo xtask"), "{args:?}: {stderr}");
    }
}

#[test]
fn help_exits_0() {
    let out = xtask(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("--kernel K"));
    assert!(String::from_utf8_lossy(&out.stdout).contains("--env NAME[=VALUE]"));
}
