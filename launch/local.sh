#!/usr/bin/env bash
# One node, N processes: launch/local.sh N +algo=NAME [key=value ...]
# Uses --standalone rendezvous (a free port on localhost), so two local runs never clash on 29500.
set -euo pipefail
nproc="${1:?usage: launch/local.sh NPROC +algo=NAME [overrides...]}"
shift
backend=()
[[ " $* " == *" backend="* ]] || backend=(backend=ddp)
exec torchrun --standalone --nproc_per_node="$nproc" "$(dirname "$0")/../train.py" "${backend[@]}" "$@"
