//! Compiles `podsim/v1/*.proto` with protox (a pure-Rust protobuf compiler) and generates the
//! prost messages and tonic services from the resulting descriptor set: no system `protoc`.

use std::path::Path;

const PROTOS: &[&str] = &["podsim/v1/link.proto", "podsim/v1/control.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read when the script runs, not when it is compiled: a script built for one checkout
    // and reused from a shared target folder by another read the first one's protos.
    let root = std::env::var("CARGO_MANIFEST_DIR")?;
    let root = Path::new(&root);
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    println!("cargo:rerun-if-changed=build.rs");
    let descriptors = protox::compile(PROTOS, [root])?;
    // Payload bytes decode as `bytes::Bytes`: a slice of the received buffer, not a copy.
    tonic_prost_build::configure()
        .bytes(".podsim.v1.Payload.f32_le")
        .compile_fds(descriptors)?;
    Ok(())
}
