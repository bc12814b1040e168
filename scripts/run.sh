#!/usr/bin/env bash
# `make run`: the whole suite on this machine - a Redis (when none answers at REDIS_URL), the scheduler,
# WORKERS workers (default 1; on the CPU when there is no GPU), one worker for each of EXTRA_MODELS,
# BATCH_WORKERS batch workers (Celery, default 1) and the gateway on http://HOST:PORT.
# A service that exits on its own is started again after RESTART_DELAY_S (as compose's restart policy does).
# Ctrl-C stops everything this script started. Settings: the environment, as listed by each service's --help.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
WORKERS=${WORKERS:-1}
BATCH_WORKERS=${BATCH_WORKERS:-1}
RESTART_DELAY_S=${RESTART_DELAY_S:-1}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
export HOST=${HOST:-127.0.0.1}
export PORT=${PORT:-8000}
export HF_HUB_OFFLINE=1

pids=()
stop_all() {
  local status=$?
  trap - INT TERM EXIT
  echo "stopping..."
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  exit "$status"  # also out of the wait for /ready, should the signal come during start-up
}
trap stop_all INT TERM EXIT

# Runs a service and starts it again whenever it exits, until this script stops it (TERM: stop the service).
supervise() {
  local name=$1 child
  shift
  trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 0' TERM INT
  while true; do
    "$@" &
    child=$!
    wait "$child" && status=0 || status=$?
    echo "$name exited with status $status; starting it again in ${RESTART_DELAY_S}s" >&2
    sleep "$RESTART_DELAY_S"
  done
}

redis_answers() {
  "$PY" -c "import os, redis; redis.Redis.from_url(os.environ['REDIS_URL'], socket_connect_timeout=1).ping()" \
    2>/dev/null
}

if ! redis_answers; then
  if ! command -v redis-server >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    else
      echo "no Redis answers at $REDIS_URL and redis-server is not installed (apt-get install redis-server)" >&2
      exit 1
    fi
  fi
  redis_port=$("$PY" -c "import os, urllib.parse; print(urllib.parse.urlparse(os.environ['REDIS_URL']).port or 6379)")
  # As compose and Kubernetes run it: every write in the append-only file (fsynced every second) under
  # REDIS_DATA_DIR, so a Redis that crashed comes back with every request; writes refused, not evicted, when full.
  redis_dir=${REDIS_DATA_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/pagedserve/redis}
  mkdir -p "$redis_dir"
  echo "starting redis-server on port $redis_port (data in $redis_dir)"
  supervise redis-server redis-server --port "$redis_port" --bind 127.0.0.1 --dir "$redis_dir" \
    --appendonly yes --appendfsync everysec --save "" --maxmemory-policy noeviction --loglevel warning &
  pids+=($!)
  for _ in $(seq 50); do redis_answers && break; sleep 0.1; done
fi

# De-quantize the model once, before several processes would each start doing it.
"$PY" -c "import os; from gpu_worker.engine.model_loader import resolve_model_path; resolve_model_path(os.environ.get('MODEL'))"

supervise scheduler "$PY" -m scheduler_svc & pids+=($!)
for i in $(seq "$WORKERS"); do supervise "worker $i" "$PY" -m gpu_worker & pids+=($!); done
# EXTRA_MODELS (name=model pairs, comma-separated): the gateway and the batch workers serve those too, and one
# worker of each starts here (SERVED_MODEL_NAME=name MODEL=model).
IFS=',' read -ra extra_models <<< "${EXTRA_MODELS:-}"
for pair in "${extra_models[@]}"; do
  [ -n "$pair" ] || continue
  name=${pair%%=*} model=${pair#*=}
  SERVED_MODEL_NAME=$name MODEL=$model supervise "worker of $name" "$PY" -m gpu_worker & pids+=($!)
done
for i in $(seq "$BATCH_WORKERS"); do supervise "batch worker $i" "$PY" -m gateway.batch & pids+=($!); done
supervise gateway "$PY" -m gateway & pids+=($!)

url="http://$HOST:$PORT"
for _ in $(seq 600); do
  if curl -sf "$url/ready" >/dev/null 2>&1; then break; fi
  sleep 0.5
done
if ! curl -sf "$url/ready" >/dev/null 2>&1; then
  echo "the services did not become ready" >&2
  exit 1
fi
cat <<MSG

pagedserve is ready: point an OpenAI client at $url/v1 (any API key unless API_KEYS is set)

  curl -N $url/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "SmolLM2-135M-Instruct", "stream": true, "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}'

Ctrl-C stops everything.
MSG
wait -n
