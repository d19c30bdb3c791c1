#!/usr/bin/env bash
# Renders report.html of three jobs to PNG with headless Chromium, into docs/:
#   docs/report-quickstart.png   configs/quickstart.toml (DDP, data mode)
#   docs/report-transformer.png  configs/gpt2_fsdp_meta.toml (GPT-2 under FSDP, meta mode)
#   docs/report-stall.png        configs/faults/stall.toml (a stalled chip, diagnosed)
# Installs Debian's chromium when it is missing (root, or sudo). Usage:
#   bash scripts/screenshots.sh [PODSIM]     (default: builds and uses target/debug/podsim)
set -euo pipefail
cd "$(dirname "$0")/.."
podsim=${1:-}
if [ -z "$podsim" ]; then
    cargo build --quiet --bin podsim
    podsim=target/debug/podsim
fi
if ! command -v chromium >/dev/null; then
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
shoot() { # name config height
    local dir="$out/$1"
    # The stall job exits 3 (a diagnosed hang): its page is what we want.
    "$podsim" launch "$2" --out "$dir" >/dev/null 2>&1 || [ $? -eq 3 ]
    chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1120,"$3" \
        --screenshot="docs/report-$1.png" "file://$dir/report.html" >/dev/null 2>&1
    echo "docs/report-$1.png"
}
shoot quickstart configs/quickstart.toml 1450
shoot transformer configs/gpt2_fsdp_meta.toml 1500
shoot stall configs/faults/stall.toml 900
