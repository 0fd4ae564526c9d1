#!/usr/bin/env bash
# A multi-node run without Slurm and without ssh: one command per node, typed (or started by
# your own tooling) on that node. See docs/multinode.md.
#
#   head node:    scripts/multihost.sh head --workers gpu1,gpu2 [-c run.yaml] [-- RUN OPTIONS]
#   each worker:  scripts/multihost.sh worker --head HEAD --name gpu1 --keys DIR [-- NODE OPTIONS]
#
# The head makes CURVE keys (once) and one bundle per worker, <run-dir>/keys/nodes/<name>/,
# holding that worker's keys and the Redis URL (password included, mode 0600). Copy each
# bundle to its worker (scp, rsync, a USB stick: how is up to you), then start the worker.
# Workers may start before the head is up: they wait for it.
set -euo pipefail

# --- settings: flags below override these; so does the environment ------------------------
AUTODIDACT="${AUTODIDACT:-autodidact}"  # the CLI; e.g. ".venv/bin/python -m autodidact"
RUN_DIR="${RUN_DIR:-runs/multihost}"    # head: the run; worker: this node's own directory
CONFIG="${CONFIG:-}"                    # -c FILE, the same file on every node
REDIS_PORT="${REDIS_PORT:-6379}"        # the head's ports, reachable from every worker
REPLAY_PORT="${REPLAY_PORT:-5555}"
WEIGHTS_PORT="${WEIGHTS_PORT:-5556}"
GPUS="${GPUS:-0}"                       # head: learner processes (learner.nproc); worker: GPUs
ACTORS="${ACTORS:-}"                    # worker: actors (default: GPUS, or 1 without GPUs)
JUDGES="${JUDGES:-0}"                   # worker: judges besides the head's (judge.workers)

usage() {
  cat <<'EOF'
usage:
  multihost.sh head   --workers NAME[,NAME...] [--host HOST] [--gpus N] [--run-dir DIR]
                      [-c CONFIG] [-- autodidact run options, e.g. --set model.path=/m]
  multihost.sh worker --head HOST --keys DIR [--name NAME] [--gpus N] [--actors N]
                      [--judges M] [--run-dir DIR] [-c CONFIG] [-- autodidact node options]

head:   makes <run-dir>/keys (once) with a bundle per worker, <run-dir>/keys/nodes/NAME/
        (its CURVE keys + redis_url), prints what to copy where, then runs
        `autodidact run` with no local actors, Redis, replay and the weight server on all
        interfaces, CURVE on, the learner on --gpus GPUs (learner.nproc; 0 or 1: one).
        --host is how workers reach this machine (default: hostname -f).
worker: runs `autodidact node` against --head with the bundle --keys (copied from the head):
        --actors actors (default --gpus, else 1), actor i pinned to GPU i with --gpus.
        --name defaults to the short host name; it must be the bundle's name.
Give every node the same -c and model/env --set options (model.path must exist on each).
Environment: AUTODIDACT RUN_DIR CONFIG REDIS_PORT REPLAY_PORT WEIGHTS_PORT GPUS ACTORS JUDGES.
EOF
}

die() { echo "multihost.sh: $*" >&2; exit 2; }

read -r -a AD <<<"$AUTODIDACT"  # the CLI may be several words

head_node() {
  local workers="" host="" name mask
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --workers) workers="$2"; shift 2 ;;
      --host) host="$2"; shift 2 ;;
      --gpus) GPUS="$2"; shift 2 ;;
      --run-dir) RUN_DIR="$2"; shift 2 ;;
      -c|--config) CONFIG="$2"; shift 2 ;;
      -h|--help) usage; exit 0 ;;
      --) shift; break ;;
      *) die "head: unknown option $1 (options for autodidact run go after --)" ;;
    esac
  done
  [[ -n "$workers" ]] || die "head: --workers NAME[,NAME...] is required"
  host="${host:-$(hostname -f)}"
  local keys="$RUN_DIR/keys"
  IFS=, read -r -a names <<<"$workers"
  mkdir -p "$RUN_DIR/redis"
  mask="$(umask)"
  umask 077  # the files made below hold secrets
  # CURVE keys, made once: server pair, this machine's client pair, one pair per worker.
  if [[ ! -f "$keys/server.key" ]]; then
    local args=()
    for name in "${names[@]}"; do args+=(--client "$name"); done
    "${AD[@]}" keys generate --out "$keys" "${args[@]}"
  fi
  # The embedded Redis takes its password from this file (made here if missing), so each
  # worker's URL is known before the server starts.
  local pwfile="$RUN_DIR/redis/password"
  [[ -s "$pwfile" ]] || od -An -N24 -tx1 /dev/urandom | tr -d ' \n' >"$pwfile"
  echo "worker bundles (copy each to its node, then start the worker there):"
  for name in "${names[@]}"; do
    [[ -d "$keys/nodes/$name" ]] || die "no keys for worker $name in $keys/nodes (the keys" \
      "were made for other names: remove $keys to make them again)"
    printf 'redis://:%s@%s:%s/0\n' "$(<"$pwfile")" "$host" "$REDIS_PORT" \
      >"$keys/nodes/$name/redis_url"
    echo "  $keys/nodes/$name/  ->  node $name:"
    echo "    scripts/multihost.sh worker --head $host --name $name --keys <that copy>" \
      "${CONFIG:+-c $CONFIG}"
  done
  local run=(run --run-dir "$RUN_DIR"
    --set actor.num_actors=0
    --set "redis.bind=0.0.0.0:$REDIS_PORT"
    --set "replay.address=tcp://0.0.0.0:$REPLAY_PORT"
    --set "weights.address=tcp://0.0.0.0:$WEIGHTS_PORT"
    --set "security.keys_dir=$keys")
  [[ -z "$CONFIG" ]] || run+=(-c "$CONFIG")
  if [[ "$GPUS" -gt 0 ]]; then run+=(--set learner.device=cuda --set "learner.nproc=$GPUS"); fi
  umask "$mask"
  exec "${AD[@]}" "${run[@]}" "$@"
}

worker_node() {
  local head="" name="" keys=""
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --head) head="$2"; shift 2 ;;
      --name) name="$2"; shift 2 ;;
      --keys) keys="$2"; shift 2 ;;
      --gpus) GPUS="$2"; shift 2 ;;
      --actors) ACTORS="$2"; shift 2 ;;
      --judges) JUDGES="$2"; shift 2 ;;
      --run-dir) RUN_DIR="$2"; shift 2 ;;
      -c|--config) CONFIG="$2"; shift 2 ;;
      -h|--help) usage; exit 0 ;;
      --) shift; break ;;
      *) die "worker: unknown option $1 (options for autodidact node go after --)" ;;
    esac
  done
  [[ -n "$head" ]] || die "worker: --head HOST is required"
  [[ -n "$keys" ]] || die "worker: --keys DIR (this node's bundle from the head) is required"
  [[ -f "$keys/redis_url" ]] || die "worker: $keys/redis_url missing: copy the whole bundle"
  name="${name:-$(hostname -s)}"
  if [[ -z "$ACTORS" ]]; then
    if [[ "$GPUS" -gt 0 ]]; then ACTORS="$GPUS"; else ACTORS=1; fi
  fi
  local node=(node --node-name "$name" --run-dir "$RUN_DIR"
    --actors "$ACTORS" --judges "$JUDGES" --gpus-per-node "$GPUS"
    --redis-url-file "$keys/redis_url"
    --replay-addr "tcp://$head:$REPLAY_PORT"
    --weights-addr "tcp://$head:$WEIGHTS_PORT"
    --set "security.keys_dir=$keys")
  [[ -z "$CONFIG" ]] || node+=(-c "$CONFIG")
  exec "${AD[@]}" "${node[@]}" "$@"
}

case "${1:-}" in
  head) shift; head_node "$@" ;;
  worker) shift; worker_node "$@" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
