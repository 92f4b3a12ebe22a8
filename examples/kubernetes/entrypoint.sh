#!/bin/sh
# The pod contract of a checkpointless job on Kubernetes (examples/kubernetes/job.yaml): one pod per
# host, each running one `checkpointless agent`; index 0 also runs the job's coordinator.
#
#   index 0 .. N-1      worker hosts (index i starts with ranks i*P .. i*P+P-1); index 0 also runs
#                       `checkpointless coordinator` in the background
#   index N .. N+S-1    spare hosts (`--spare`): kept warm, each takes all the ranks of a lost host
#
# Environment (job.yaml sets it; the sizes come from the ckpt-config ConfigMap):
#   JOB_COMPLETION_INDEX             this pod's index, 0 .. N+S-1 (Kubernetes sets it in an Indexed Job)
#   CHECKPOINTLESS_NODES             N: worker hosts
#   CHECKPOINTLESS_SPARE_NODES       S: spare hosts
#   CHECKPOINTLESS_NPROC_PER_NODE    P: processes per host (one per GPU)
#   CHECKPOINTLESS_COORDINATOR_HOST  the coordinator's DNS name: index 0's pod, <job>-0.<service>
#   CHECKPOINTLESS_PORT              the coordinator's control-store port
#   CHECKPOINTLESS_SECRET_FILE       the job's secret (64 hex digits) as a file: a Secret volume
#   CHECKPOINTLESS_OUT               index 0: where the coordinator writes events.jsonl, report.json
#   POD_IP                           optional: this pod's address (downward API status.podIP), which
#                                    the coordinator binds to and this host's processes bind to
#   CHECKPOINTLESS_JOIN_TIMEOUT      optional: seconds for every pod's agent to join (default 600:
#                                    the job starts only once every pod runs; image pulls take time)
#   CHECKPOINTLESS_COORDINATOR_ARGS  optional: the job's options for the coordinator, split on
#                                    blanks (--steps 1000 --hang-timeout 5 --backend nccl ...)
#   CHECKPOINTLESS_LOG_DIR           optional: where this host's processes write their logs
#   CHECKPOINTLESS_LINGER            optional: seconds a pod other than index 0 waits after its agent
#                                    ended cleanly (default 30; see "Exit codes")
# Arguments: the training command, e.g. `python train.py --lr 3e-4`.
#
# Exit codes: index 0 exits 0 when the coordinator ended the job successfully and 42 otherwise (the
# Job's podFailurePolicy fails the whole Job on 42). The other indexes exit with their agent's code:
# 0 (the job ended), 3 (lost the coordinator: it fenced itself), 2 (refused or not accepted), 128+n
# (a signal). After a clean end they wait up to CHECKPOINTLESS_LINGER seconds (until the Job
# controller removes them) so that index 0's success is seen while they still run: the Job's success
# policy ("index 0 succeeded") then holds even if a lost host's index failed earlier, which the
# controller would otherwise weigh first once every index had ended.
set -u

say() { echo "checkpointless entrypoint ($(uname -n)): $*" >&2; }
die() { say "$*"; exit 2; }

need() { eval "value=\${$1:-}" && [ -n "$value" ] || die "$1 is not set: $2"; }
need JOB_COMPLETION_INDEX "run this as a pod of an Indexed Job (completionMode: Indexed)"
need CHECKPOINTLESS_NODES "N, the worker hosts"
need CHECKPOINTLESS_SPARE_NODES "S, the spare hosts"
need CHECKPOINTLESS_NPROC_PER_NODE "P, the processes per host"
need CHECKPOINTLESS_COORDINATOR_HOST "the coordinator's DNS name, <job>-0.<service>"
need CHECKPOINTLESS_PORT "the coordinator's port"
need CHECKPOINTLESS_SECRET_FILE "the job's secret file, a Secret volume"
need CHECKPOINTLESS_OUT "where the coordinator writes its files"
POD_IP=${POD_IP:-}
JOIN_TIMEOUT=${CHECKPOINTLESS_JOIN_TIMEOUT:-600}
LINGER=${CHECKPOINTLESS_LINGER:-30}
[ "$#" -gt 0 ] || die "give the training command as the container's args, e.g. python train.py"

number() { case $2 in '' | *[!0-9]*) die "$1=$2: expected a whole number" ;; esac; }
number JOB_COMPLETION_INDEX "$JOB_COMPLETION_INDEX"
number CHECKPOINTLESS_NODES "$CHECKPOINTLESS_NODES"
number CHECKPOINTLESS_SPARE_NODES "$CHECKPOINTLESS_SPARE_NODES"
number CHECKPOINTLESS_NPROC_PER_NODE "$CHECKPOINTLESS_NPROC_PER_NODE"
number CHECKPOINTLESS_PORT "$CHECKPOINTLESS_PORT"
number CHECKPOINTLESS_LINGER "$LINGER"
index=$JOB_COMPLETION_INDEX
nodes=$CHECKPOINTLESS_NODES
hosts=$((nodes + CHECKPOINTLESS_SPARE_NODES))
[ "$index" -lt "$hosts" ] ||
    die "index $index: the job has $nodes worker and $CHECKPOINTLESS_SPARE_NODES spare host(s): set the Job's completions and parallelism to $hosts"
coordinator=$CHECKPOINTLESS_COORDINATOR_HOST:$CHECKPOINTLESS_PORT

# The secret: checkpointless refuses a file that others may read, or that is not this user's. A
# Secret volume owned by root with defaultMode 0400 serves a root container as it is; a non-root
# one (the volume then needs an fsGroup, which adds group read) reads a private copy in memory.
secret=$CHECKPOINTLESS_SECRET_FILE
[ -r "$secret" ] || die "cannot read the secret file $secret (a non-root container needs the pod's fsGroup)"
private=
trap '[ -z "$private" ] || rm -rf "$private"' EXIT
mode=$(stat -L -c %a "$secret") || die "cannot stat $secret"
if [ "$(stat -L -c %u "$secret")" != "$(id -u)" ] || [ $((0$mode & 077)) -ne 0 ]; then
    private=$(mktemp -d /dev/shm/checkpointless-secret.XXXXXX 2>/dev/null || mktemp -d) || die "mktemp failed"
    (umask 077 && cat "$secret" >"$private/secret") || die "cannot copy $secret"
    secret=$private/secret
fi

# The agent: this host in the job. --addr pins its processes' data plane to the pod's address
# (without it the agent takes the address it reaches the coordinator from).
if [ "$index" -lt "$nodes" ]; then
    role="worker host $index"
    placement="--node-rank $index"
else
    role="spare host"
    placement=--spare
fi
set -f # the blank-separated option lists below are split, never globbed
set -- checkpointless agent --coordinator "$coordinator" --secret-file "$secret" \
    --nproc-per-node "$CHECKPOINTLESS_NPROC_PER_NODE" --host-name "$(uname -n)" $placement \
    --join-timeout "$JOIN_TIMEOUT" ${POD_IP:+--addr "$POD_IP"} \
    ${CHECKPOINTLESS_LOG_DIR:+--log-dir "$CHECKPOINTLESS_LOG_DIR"} -- "$@"

# Children run in the background so that this shell (the container's PID 1) passes SIGTERM on:
# wait_for PID returns the child's exit status across the signals trapped here.
children=
trap 'say "stopping ($role)"; [ -z "$children" ] || kill -TERM $children 2>/dev/null' TERM INT
wait_for() {
    while :; do
        wait "$1"
        waited=$?
        kill -0 "$1" 2>/dev/null || return "$waited"
    done
}

if [ "$index" -ne 0 ]; then
    say "$role of $hosts, coordinator $coordinator"
    "$@" &
    children=$!
    wait_for "$children"
    code=$?
    children=
    say "agent exited $code"
    if [ "$code" -eq 0 ] && [ "$LINGER" -gt 0 ]; then
        sleep "$LINGER" &
        children=$!
        wait_for "$children"
    fi
    [ "$code" -ne 42 ] || code=1 # 42 is index 0's "the job failed"
    exit "$code"
fi

bind=${POD_IP:-0.0.0.0}
say "coordinator on $bind:$CHECKPOINTLESS_PORT ($nodes worker and $CHECKPOINTLESS_SPARE_NODES spare host(s), $CHECKPOINTLESS_NPROC_PER_NODE process(es) each) and $role"
checkpointless coordinator --nodes "$nodes" --nproc-per-node "$CHECKPOINTLESS_NPROC_PER_NODE" \
    --spare-nodes "$CHECKPOINTLESS_SPARE_NODES" --secret-file "$secret" --bind "$bind" \
    --port "$CHECKPOINTLESS_PORT" --out "$CHECKPOINTLESS_OUT" --join-timeout "$JOIN_TIMEOUT" \
    ${CHECKPOINTLESS_COORDINATOR_ARGS:-} &
coord=$!
"$@" &
agent=$!
children="$coord $agent"
wait_for "$coord"
result=$?
children=$agent
# the coordinator stopped every agent at the end; one that failed leaves this pod's agent nothing to do
[ "$result" -eq 0 ] || kill -TERM "$agent" 2>/dev/null
wait_for "$agent"
code=$?
children=
say "coordinator exited $result, this host's agent $code"
[ "$result" -eq 0 ] || exit 42
exit 0
