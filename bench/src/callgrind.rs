//! Reads valgrind's callgrind profiles: total instructions and syscalls, each function's own
//! instructions, and the calls into the C heap allocator. Counts, not times: the same binary
//! with the same inputs gives the same figures however busy the (emulated) machine is.
//!
//! The format (callgrind's "Callgrind Format Specification"): `fn=` starts a function's cost
//! lines, `calls=N target` says the next cost line is the inclusive cost of N calls to `cfn=`
//! (so it is not the caller's own cost), names may be compressed to `(id) name` the first time
//! and `(id)` afterwards, and the `events:` header names the columns of every cost line.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};

/// The C allocator's entry points: a call to one of them is one heap allocation (Rust's
/// `__rust_alloc` and `__rust_realloc` end in them, and so does any C library's allocation).
pub const ALLOCATORS: &[&str] = &[
    "malloc",
    "calloc",
    "realloc",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    // glibc's own names for the same functions, which a profile may show instead.
    "__libc_malloc",
    "__libc_calloc",
    "__libc_realloc",
    "__libc_memalign",
    "__posix_memalign",
];

/// The clock's entry points. Under valgrind they are system calls (it hides the vDSO that
/// answers them natively without one), so they are counted apart from the other syscalls.
pub const CLOCKS: &[&str] = &[
    "clock_gettime",
    "__clock_gettime",
    "__clock_gettime64",
    "gettimeofday",
];

/// A function's name without its symbol version (`clock_gettime@@GLIBC_2.17`).
fn unversioned(name: &str) -> &str {
    name.split('@').next().unwrap_or(name)
}

/// What one profile counted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    /// Instructions executed in user space (event `Ir`).
    pub instructions: u64,
    /// System calls (event `sysCount`, with `--collect-systime=yes`; 0 without), clock
    /// reads left out.
    pub syscalls: u64,
    /// Calls to read the clock ([`CLOCKS`]): a vDSO call natively, a syscall under valgrind.
    pub clock_reads: u64,
    /// Calls into the heap allocator ([`ALLOCATORS`]).
    pub allocations: u64,
    /// Each function's own instructions (callees excluded), by name; functions without a
    /// symbol are named by address and object.
    pub by_function: HashMap<String, u64>,
}

/// Parses a callgrind output file.
pub fn parse(text: &str) -> Result<Profile> {
    let mut p = Profile::default();
    let mut events: Vec<String> = Vec::new();
    let mut names: HashMap<(char, u64), String> = HashMap::new();
    let mut object = String::new();
    let mut function = String::new();
    let mut callee = String::new();
    // The next cost line is a call's inclusive cost, not the function's own.
    let mut call_cost_next = false;
    let mut saw_totals = false;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end();
        if let Some(rest) = line.strip_prefix("events:") {
            events = rest.split_whitespace().map(str::to_owned).collect();
        } else if let Some(rest) = line.strip_prefix("totals:") {
            let (ir, sys) = columns(&events, rest.split_whitespace())?;
            p.instructions = ir;
            p.syscalls = sys;
            saw_totals = true;
        } else if let Some(rest) = line.strip_prefix("ob=") {
            object = name(&mut names, 'o', rest);
        } else if let Some(rest) = line.strip_prefix("fn=") {
            function = name(&mut names, 'f', rest);
            if function.starts_with("0x") {
                let obj = object.rsplit('/').next().unwrap_or(&object);
                function = format!("{function} ({obj})");
            }
        } else if let Some(rest) = line.strip_prefix("cfn=") {
            callee = name(&mut names, 'f', rest);
        } else if let Some(rest) = line.strip_prefix("cob=") {
            name(&mut names, 'o', rest);
        } else if let Some(rest) = line
            .strip_prefix("fl=")
            .or_else(|| line.strip_prefix("fi="))
            .or_else(|| line.strip_prefix("fe="))
            .or_else(|| line.strip_prefix("cfi="))
            .or_else(|| line.strip_prefix("cfl="))
        {
            name(&mut names, 'l', rest);
        } else if let Some(rest) = line.strip_prefix("calls=") {
            let count: u64 = rest
                .split_whitespace()
                .next()
                .and_then(|c| c.parse().ok())
                .with_context(|| format!("line {}: bad calls= line", n + 1))?;
            let callee = unversioned(&callee);
            if ALLOCATORS.contains(&callee) {
                p.allocations += count;
            } else if CLOCKS.contains(&callee) {
                p.clock_reads += count;
            }
            call_cost_next = true;
        } else if line.starts_with(|c: char| c.is_ascii_digit() || "+-*".contains(c)) {
            if std::mem::take(&mut call_cost_next) {
                continue;
            }
            // The first column is the position; the events follow (trailing zeros omitted).
            let mut cols = line.split_whitespace();
            cols.next();
            let ir = match cols.next() {
                Some(v) => v
                    .parse::<u64>()
                    .with_context(|| format!("line {}: bad cost {v:?}", n + 1))?,
                None => 0,
            };
            if ir > 0 {
                *p.by_function.entry(function.clone()).or_default() += ir;
            }
        } else if line.starts_with("jump=") || line.starts_with("jcnd=") {
            // Jump lines are followed by no cost line of their own.
        }
    }
    if !saw_totals {
        // Older callgrinds write `summary:` only.
        if let Some(rest) = text.lines().find_map(|l| l.strip_prefix("summary:")) {
            let (ir, sys) = columns(&events, rest.split_whitespace())?;
            p.instructions = ir;
            p.syscalls = sys;
        } else {
            bail!("no totals: or summary: line (is this a callgrind profile?)");
        }
    }
    p.syscalls = p.syscalls.saturating_sub(p.clock_reads);
    Ok(p)
}

/// The `Ir` and `sysCount` columns of a totals line.
fn columns<'a>(events: &[String], values: impl Iterator<Item = &'a str>) -> Result<(u64, u64)> {
    let values: Vec<u64> = values
        .map(|v| v.parse().with_context(|| format!("bad total {v:?}")))
        .collect::<Result<_>>()?;
    let at = |event: &str| {
        events
            .iter()
            .position(|e| e == event)
            .and_then(|i| values.get(i).copied())
    };
    let ir = at("Ir").context("the profile has no Ir event")?;
    Ok((ir, at("sysCount").unwrap_or(0)))
}

/// Resolves a possibly compressed name: `(id) name` defines, `(id)` refers, a plain name is
/// itself.
fn name(names: &mut HashMap<(char, u64), String>, kind: char, spec: &str) -> String {
    let spec = spec.trim();
    let Some(rest) = spec.strip_prefix('(') else {
        return spec.to_owned();
    };
    let Some((id, tail)) = rest.split_once(')') else {
        return spec.to_owned();
    };
    let Ok(id) = id.parse::<u64>() else {
        return spec.to_owned();
    };
    let tail = tail.trim();
    if tail.is_empty() {
        names.get(&(kind, id)).cloned().unwrap_or_default()
    } else {
        names.insert((kind, id), tail.to_owned());
        tail.to_owned()
    }
}

/// The cost of one unit of work (a round trip): the difference between a profile of `3n` units
/// and one of `n`, divided by `2n`, so that start-up, connection set-up and teardown cancel.
#[derive(Debug, Clone, PartialEq)]
pub struct PerUnit {
    /// Instructions per unit.
    pub instructions: f64,
    /// System calls per unit, clock reads left out.
    pub syscalls: f64,
    /// Clock reads per unit.
    pub clock_reads: f64,
    /// Heap allocations per unit.
    pub allocations: f64,
    /// The functions with the most own instructions per unit, most first.
    pub top: Vec<(String, f64)>,
}

/// [`PerUnit`] of `small` (`n` units) and `large` (`n + units` units).
pub fn per_unit(small: &Profile, large: &Profile, units: u64, top: usize) -> PerUnit {
    let u = units.max(1) as f64;
    let diff = |a: u64, b: u64| (b as f64 - a as f64) / u;
    let mut funcs: Vec<(String, f64)> = large
        .by_function
        .iter()
        .map(|(f, &b)| {
            let a = small.by_function.get(f).copied().unwrap_or(0);
            (f.clone(), diff(a, b))
        })
        .filter(|(_, v)| *v > 0.0)
        .collect();
    funcs.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    funcs.truncate(top);
    PerUnit {
        instructions: diff(small.instructions, large.instructions),
        syscalls: diff(small.syscalls, large.syscalls),
        clock_reads: diff(small.clock_reads, large.clock_reads),
        allocations: diff(small.allocations, large.allocations),
        top: funcs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROFILE: &str = "# callgrind format
version: 1
creator: callgrind-3.19.0
positions: line
events: Ir sysCount sysTime
summary: 1000 7 3

ob=(1) /usr/bin/prog
fl=(1) prog.c
fn=(1) main
10 100
+2 50
cob=(2) /usr/lib/libc.so.6
cfi=(2) malloc.c
cfn=(2) malloc
calls=3 0x10
12 600
cfn=(3) write
calls=2 0x20
13 40
cfn=(5) clock_gettime@@GLIBC_2.17
calls=1 0x30
13 9
14 5
fn=(2)
0x10 600
fn=(4) 0x0000000000003cc0
20 200
totals: 1000 7 3
";

    #[test]
    fn own_costs_exclude_calls_and_allocator_calls_are_counted() {
        let p = parse(PROFILE).unwrap();
        assert_eq!(p.instructions, 1000);
        assert_eq!(p.syscalls, 6, "the clock read is not counted as a syscall");
        assert_eq!(p.clock_reads, 1);
        assert_eq!(p.allocations, 3);
        assert_eq!(p.by_function["main"], 155);
        assert_eq!(p.by_function["malloc"], 600);
        assert_eq!(p.by_function["0x0000000000003cc0 (prog)"], 200);
        assert!(!p.by_function.contains_key("write"));
    }

    #[test]
    fn per_unit_is_the_difference_of_two_runs() {
        let small = parse(PROFILE).unwrap();
        let mut large = small.clone();
        large.instructions += 2000;
        large.syscalls += 8;
        large.allocations += 1;
        *large.by_function.get_mut("main").unwrap() += 1500;
        *large.by_function.get_mut("malloc").unwrap() += 500;
        let u = per_unit(&small, &large, 1000, 1);
        assert_eq!(u.instructions, 2.0);
        assert_eq!(u.syscalls, 0.008);
        assert_eq!(u.allocations, 0.001);
        assert_eq!(u.top, vec![("main".to_owned(), 1.5)]);
    }

    #[test]
    fn a_file_without_totals_is_an_error() {
        assert!(parse("events: Ir\nfn=main\n1 2\n").is_err());
    }
}
