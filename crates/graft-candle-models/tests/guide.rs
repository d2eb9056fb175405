//! The guide's graft-candle-models examples (examples/guide.rs and examples/serving.rs, shown
//! in docs/guide.md) run on the CPU (tests/gpu.rs runs them on the GPU in the `cuda` build),
//! and the guide shows them as they are.

#[cfg(not(feature = "cuda"))]
#[path = "../examples/guide.rs"]
mod guide;
#[cfg(not(feature = "cuda"))]
#[path = "../examples/serving.rs"]
mod serving;

#[test]
#[cfg(not(feature = "cuda"))]
fn the_guide_example_runs() {
    if let Err(e) = guide::main() {
        panic!("the guide's candle example failed: {e}");
    }
}

#[test]
#[cfg(not(feature = "cuda"))]
fn the_serving_example_runs() {
    if let Err(e) = serving::main() {
        panic!("the guide's serving example failed: {e}");
    }
}

/// docs/guide.md shows examples/serving.rs character for character.
#[test]
fn the_guide_shows_the_serving_example_as_it_is() {
    let root = env!("CARGO_MANIFEST_DIR");
    let example = std::fs::read_to_string(format!("{root}/examples/serving.rs")).unwrap();
    let guide = std::fs::read_to_string(format!("{root}/../../docs/guide.md")).unwrap();
    let start = guide
        .find("```rust,ignore\n//! The serving example")
        .expect("docs/guide.md has the serving example in a rust,ignore block");
    let body = &guide[start + "```rust,ignore\n".len()..];
    let end = body.find("\n```").expect("the block ends");
    assert_eq!(
        &body[..end + 1],
        example,
        "update docs/guide.md's serving example to match examples/serving.rs"
    );
}

/// docs/guide.md's candle example is examples/guide.rs, character for character.
#[test]
fn the_guide_shows_the_example_as_it_is() {
    let root = env!("CARGO_MANIFEST_DIR");
    let example = std::fs::read_to_string(format!("{root}/examples/guide.rs")).unwrap();
    let guide = std::fs::read_to_string(format!("{root}/../../docs/guide.md")).unwrap();
    let start = guide
        .find("```rust,ignore\n//! The candle example")
        .expect("docs/guide.md has the candle example in a rust,ignore block");
    let body = &guide[start + "```rust,ignore\n".len()..];
    let end = body.find("\n```").expect("the block ends");
    assert_eq!(
        &body[..end + 1],
        example,
        "update docs/guide.md's candle example to match examples/guide.rs"
    );
}
