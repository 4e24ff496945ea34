//! The project's scripts (`scripts/`, and the Python benchmarks of `python/bench/`): every
//! shell script parses (`bash -n`) and every Python one compiles, so that a benchmark or check
//! that runs only on a GPU node, which CI has not, does not first fail there on its syntax.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The scripts and the interpreter their first line names (`bash`, `python3`), or their
/// extension (`.py`, run as `python python/bench/NAME.py`).
fn scripts() -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found: Vec<(PathBuf, String)> = ["scripts", "python/bench"]
        .iter()
        .flat_map(|dir| std::fs::read_dir(root.join(dir)).expect("a scripts directory"))
        .map(|e| e.expect("a directory entry").path())
        .filter_map(|path| {
            let text = std::fs::read_to_string(&path).ok()?;
            let first = text.lines().next()?.to_string();
            let named = ["bash", "python3"]
                .into_iter()
                .find(|i| first.starts_with("#!") && first.contains(i));
            let python = path.extension().is_some_and(|e| e == "py");
            let interpreter = named.or(python.then_some("python3"))?;
            Some((path, interpreter.to_string()))
        })
        .collect();
    found.sort();
    found
}

#[test]
fn every_script_parses() {
    let found = scripts();
    // bench-exposure, gpu-check, test and the others: a listing that lost them fails here
    assert!(found.len() >= 15, "only {} scripts found", found.len());
    let benches = found
        .iter()
        .filter(|(p, _)| p.ends_with("bench/repeated.py"))
        .count();
    assert_eq!(
        benches, 1,
        "python/bench/repeated.py is not among the scripts"
    );
    for (path, interpreter) in found {
        let check = match interpreter.as_str() {
            "bash" => Command::new("bash").arg("-n").arg(&path).output(),
            _ => Command::new("python3")
                .args(["-c", "import ast, sys; ast.parse(open(sys.argv[1]).read())"])
                .arg(&path)
                .output(),
        }
        .expect("the interpreter runs");
        assert!(
            check.status.success(),
            "{} does not parse:\n{}",
            path.display(),
            String::from_utf8_lossy(&check.stderr)
        );
    }
}
