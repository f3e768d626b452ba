//! Putting Python frames into a native stack (the `py-spy --native`
//! picture): where the native stack shows the interpreter's evaluation loop
//! (`_PyEval_EvalFrameDefault` and friends), the Python frames replace the
//! innermost such frame and the outer ones are dropped (one C-level
//! evaluation runs many Python frames on 3.11+, so they cannot be paired one
//! to one); where it does not (native stacks cut short, as through a
//! stripped static `python3.11` without unwinding), the Python frames stand
//! above the native ones as their callers.

use super::resolve::PyFrame;
use crate::model::{Frame, FrameKind};

/// Native functions of the interpreter's evaluation loop.
const EVAL_FUNCTIONS: &[&str] = &[
    "_PyEval_EvalFrameDefault",
    "_PyEval_EvalFrame",
    "_PyEval_Vector",
    "PyEval_EvalFrameEx",
    "_PyEval_EvalCode",
    "_PyEval_EvalCodeWithName",
    "PyEval_EvalCode",
];

fn is_eval(frame: &Frame) -> bool {
    frame
        .symbol
        .as_deref()
        .is_some_and(|s| EVAL_FUNCTIONS.contains(&s))
}

/// A report frame for a Python frame.
pub fn python_frame(frame: &PyFrame) -> Frame {
    Frame {
        kind: FrameKind::Python,
        addr: String::new(),
        symbol: Some(frame.name.clone()),
        module: None,
        file: frame.file.clone(),
        line: frame.line,
        offset: None,
        inlined: Vec::new(),
    }
}

/// `native` (innermost first) with `python` (innermost first) merged in.
pub fn merge(native: Vec<Frame>, python: &[PyFrame]) -> Vec<Frame> {
    if python.is_empty() {
        return native;
    }
    let py = python.iter().map(python_frame);
    match native.iter().position(is_eval) {
        Some(first) => {
            let mut merged: Vec<Frame> = native[..first].to_vec();
            merged.extend(py);
            merged.extend(native[first + 1..].iter().filter(|f| !is_eval(f)).cloned());
            merged
        }
        None => {
            let mut merged = native;
            merged.extend(py);
            merged
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn native(symbol: &str) -> Frame {
        Frame {
            kind: FrameKind::Native,
            addr: "0x1".into(),
            symbol: Some(symbol.into()),
            module: Some("libpython3.12.so".into()),
            file: None,
            line: None,
            offset: None,
            inlined: Vec::new(),
        }
    }

    fn py(name: &str, line: u32) -> PyFrame {
        PyFrame {
            name: name.into(),
            file: Some("app.py".into()),
            line: Some(line),
        }
    }

    fn names(frames: &[Frame]) -> Vec<&str> {
        frames.iter().filter_map(|f| f.symbol.as_deref()).collect()
    }

    #[test]
    fn python_frames_replace_the_evaluation_loop() {
        let stack = vec![
            native("_PyObject_Malloc"),
            native("PyBytes_FromStringAndSize"),
            native("_PyEval_EvalFrameDefault"),
            native("PyEval_EvalCode"),
            native("_PyEval_EvalFrameDefault"),
            native("Py_RunMain"),
            native("main"),
        ];
        let merged = merge(
            stack,
            &[py("render", 6), py("handle", 8), py("<module>", 15)],
        );
        assert_eq!(
            names(&merged),
            vec![
                "_PyObject_Malloc",
                "PyBytes_FromStringAndSize",
                "render",
                "handle",
                "<module>",
                "Py_RunMain",
                "main"
            ]
        );
        assert_eq!(merged[2].kind, FrameKind::Python);
        assert_eq!(merged[2].line, Some(6));
        assert_eq!(merged[0].kind, FrameKind::Native);
    }

    #[test]
    fn without_the_evaluation_loop_python_frames_stand_above() {
        let merged = merge(vec![native("_PyObject_Malloc")], &[py("f", 1)]);
        assert_eq!(names(&merged), vec!["_PyObject_Malloc", "f"]);
        assert_eq!(merge(vec![native("a")], &[]).len(), 1);
    }
}
