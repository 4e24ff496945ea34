//! The project's scripts (`scripts/`): every shell script parses (`bash -n`) and every Python
//! one compiles, so that a benchmark or check that runs only on a GPU node, which CI has not,
//! does not first fail there on its syntax.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The scripts and the interpreter their first line names (`bash`, `python3`).
fn scripts() -> Vec<(PathBuf, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts");
    let mut found: Vec<(PathBuf, String)> = std::fs::read_dir(&dir)
        .expect("the scripts directory")
        .map(|e| e.expect("a directory entry").path())
        .filter_map(|path| {
            let text = std::fs::read_to_string(&path).ok()?;
            let first = text.lines().next()?.to_string();
            let interpreter = ["bash", "python3"]
                .into_iter()
                .find(|i| first.starts_with("#!") && first.contains(i))?;
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
