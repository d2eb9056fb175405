//! The guide's training example (examples/training.rs, shown in docs/guide.md) runs on the CPU
//! (tests/gpu.rs runs it on the GPU in the `cuda` build), and the guide shows it as it is.

#[cfg(not(feature = "cuda"))]
#[path = "../examples/training.rs"]
mod training;

#[test]
#[cfg(not(feature = "cuda"))]
fn the_training_example_runs() {
    if let Err(e) = training::main() {
        panic!("the guide's training example failed: {e}");
    }
}

/// docs/guide.md shows examples/training.rs character for character.
#[test]
fn the_guide_shows_the_training_example_as_it_is() {
    let root = env!("CARGO_MANIFEST_DIR");
    let example = std::fs::read_to_string(format!("{root}/examples/training.rs")).unwrap();
    let guide = std::fs::read_to_string(format!("{root}/../../docs/guide.md")).unwrap();
    let start = guide
        .find("```rust,ignore\n//! The training example")
        .expect("docs/guide.md has the training example in a rust,ignore block");
    let body = &guide[start + "```rust,ignore\n".len()..];
    let end = body.find("\n```").expect("the block ends");
    assert_eq!(
        &body[..end + 1],
        example,
        "update docs/guide.md's training example to match examples/training.rs"
    );
}
