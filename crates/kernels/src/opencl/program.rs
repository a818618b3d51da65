//! Building the OpenCL C programs at start-up: one program per source file (with `common.cl`
//! in front), tile sizes and the kernel set as `-D` defines. A failed build names the file and
//! the kernel the first error points into, and carries the compiler's log.

use super::kernel_set::KernelSet;
use anyhow::{anyhow, Result};
use opencl3::context::Context;
use opencl3::kernel::Kernel;
use opencl3::program::Program;
use opencl3::types::cl_device_id;
use std::collections::HashMap;

pub(super) const COMMON: &str = include_str!("common.cl");

/// A program's source file: its name (for messages) and its text.
pub(super) struct Source {
    pub(super) file: &'static str,
    pub(super) text: &'static str,
}

/// The kernel defined at or before `line` (1-based) of `src`: what a compiler error points into.
fn kernel_at(src: &str, line: usize) -> Option<String> {
    // `__kernel` may stand on the line before the signature (dpas.cl's attributes do that).
    let (mut found, mut pending) = (None, false);
    for l in src.lines().take(line) {
        pending |= l.contains("__kernel");
        if let Some(i) = l.find("void ") {
            if pending {
                let name: String = l[i + 5..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if !name.is_empty() {
                    found = Some(name);
                }
            }
            pending = false;
        }
    }
    found
}

/// The first `:LINE:` of a build log that falls inside the source.
fn first_error_line(log: &str, lines: usize) -> Option<usize> {
    for (i, _) in log.match_indices(':') {
        let digits: String = log[i + 1..].chars().take_while(|c| c.is_ascii_digit()).collect();
        if !digits.is_empty() && log[i + 1 + digits.len()..].starts_with(':') {
            if let Ok(n) = digits.parse::<usize>() {
                if (1..=lines).contains(&n) {
                    return Some(n);
                }
            }
        }
    }
    None
}

/// Compiles `src` (after `common.cl` and the kernel set's prelude) and returns its kernels by name.
pub(super) fn build(ctx: &Context, dev: cl_device_id, device_name: &str, set: &KernelSet, src: &Source, options: &str) -> Result<HashMap<String, Kernel>> {
    let text = format!("{}\n{}\n{}", set.prelude(), COMMON, src.text);
    let mut program = Program::create_from_source(ctx, &text).map_err(|e| anyhow!("creating OpenCL program {}: {e}", src.file))?;
    if let Err(e) = program.build(&[dev], options) {
        let log = program.get_build_log(dev).unwrap_or_default();
        let kernel = first_error_line(&log, text.lines().count()).and_then(|l| kernel_at(&text, l)).map(|k| format!(" in kernel {k}")).unwrap_or_default();
        return Err(anyhow!("building {} for {device_name}{kernel} failed ({e}; options `{options}`). Compiler log:\n{log}", src.file));
    }
    let names = program.kernel_names().to_string();
    let mut out = HashMap::new();
    for name in names.split(';').filter(|n| !n.is_empty()) {
        let k = Kernel::create(&program, name).map_err(|e| anyhow!("creating OpenCL kernel {name} of {}: {e}", src.file))?;
        out.insert(name.to_string(), k);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_errors_are_traced_to_their_kernel() {
        let src = "typedef int x;\n__kernel void first(int a) {\n  a;\n}\n\n__kernel __attribute__((x)) void second(int b) {\n  oops;\n}\n";
        assert_eq!(kernel_at(src, 3).as_deref(), Some("first"));
        assert_eq!(kernel_at(src, 7).as_deref(), Some("second"));
        assert_eq!(kernel_at(src, 1), None);
        let split = "inline void helper() {}\n__kernel __attribute__((x))\nvoid third(int c) {\n  oops;\n}\n";
        assert_eq!(kernel_at(split, 1), None);
        assert_eq!(kernel_at(split, 4).as_deref(), Some("third"));
        // PoCL (clang) and Intel's logs: "<source>:7:3: error" / "1:7:3: error".
        assert_eq!(first_error_line("<source>:7:3: error: use of undeclared identifier 'oops'", 8), Some(7));
        assert_eq!(first_error_line("1:7:3: error: oops", 8), Some(7));
        assert_eq!(first_error_line("no line here", 8), None);
    }
}
