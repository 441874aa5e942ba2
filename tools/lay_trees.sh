#!/usr/bin/env bash
# Lay candidate branches out for the device's A/B stages (device_benches.sh *_trees): for each branch, the
# files it changes against main, at their repository paths, under tools/_trees/<branch without "wip/">/.
# The device copies the working tree with untracked files, so the trees travel with it; delete them after
# (rm -rf tools/_trees) and never commit them.
#
#   bash tools/lay_trees.sh wip/rope-row-blocks wip/rope-write-fused
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: bash tools/lay_trees.sh BRANCH [BRANCH ...]" >&2; exit 2; }
for branch in "$@"; do
    git rev-parse --verify --quiet "$branch" > /dev/null || { echo "no branch $branch" >&2; exit 2; }
    git merge-base --is-ancestor main "$branch" || { echo "$branch is not on top of main: its files would undo main's newer changes; rebase it first" >&2; exit 2; }
done
for branch in "$@"; do
    name=${branch#wip/}
    rm -rf "tools/_trees/$name"
    git diff --name-only --diff-filter=AM "main...$branch" | while read -r f; do
        mkdir -p "tools/_trees/$name/$(dirname "$f")"
        git show "$branch:$f" > "tools/_trees/$name/$f"
    done
    deleted=$(git diff --name-only --diff-filter=D "main...$branch")
    [ -z "$deleted" ] || echo "warning: $branch deletes files a tree cannot express: $deleted" >&2
    echo "tools/_trees/$name: $(find "tools/_trees/$name" -type f | wc -l) files"
done
