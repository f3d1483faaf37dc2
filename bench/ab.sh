#!/usr/bin/env bash
# Runs one benchmark command against two checkouts in alternation, on the lent GPU machine, so a
# change's step time is compared with its base within one run's noise:
#   bash bench/ab.sh BASE_TREE ROUNDS OUT_DIR -- python3 bench/offload.py --workloads W1 --methods embedded
# BASE_TREE: a checkout of the base commit (git archive BASE | tar -x -C .base); "." is the change.
# Each side runs from a package tree of its own on PYTHONPATH (src/'s packages; a checkout from
# before the src/ layout maps its client/ to storm, with kernels/ and examples/ inside it), never
# from an install, so neither can import the other's code.
# Each command gets --out OUT_DIR/SIDE-ROUND.json appended; $STORM_COMMIT_BASE and $STORM_COMMIT_HEAD
# name the commits in the rows' meta (the device's copy of the tree has no .git of this checkout's).
set -euo pipefail
base=$1 rounds=$2 out=$3
shift 4  # the three arguments and "--"
tree() {  # $1: checkout, $2: package tree to make
    rm -rf "$2" && mkdir -p "$2"
    if [ -d "$1/src" ]; then
        cp -r "$1/src/storm" "$1/src/stormd" "$2/"
    else
        cp -r "$1/client" "$2/storm" && cp -r "$1/kernels" "$2/storm/kernels" && cp -r "$1/examples" "$2/storm/examples"
        cp -r "$1/stormd" "$2/stormd"
    fi
}
tree "$base" /tmp/ab-base
tree . /tmp/ab-head
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for side in base head; do
        src=$([ "$side" = base ] && echo "$base" || echo .)
        commit=$([ "$side" = base ] && echo "${STORM_COMMIT_BASE:-base}" || echo "${STORM_COMMIT_HEAD:-head}")
        (cd "$src" && STORM_COMMIT=$commit PYTHONPATH="/tmp/ab-$side:${PYTHONPATH:-}" "$@" --out "$out/$side-$round.json")
    done
done
# One file of every round's rows, side by side: {"base": [round1, ...], "head": [...]}
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {side: [json.loads(p.read_text()) for p in sorted(out.glob(f"{side}-*.json"), key=lambda p: int(p.stem.split("-")[1]))]
        for side in ("base", "head")}
(out / "ab.json").write_text(json.dumps(rows, indent=1) + "\n")
PY
