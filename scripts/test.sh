#!/usr/bin/env bash
# The whole test suite: formatting, lints (warnings are errors), then every test.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
