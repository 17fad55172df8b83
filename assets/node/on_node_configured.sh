#!/usr/bin/env bash
# ParallelCluster OnNodeConfigured action for a Slurm cluster with Trainium (trn1, trn2) compute nodes.
#
# ParallelCluster runs this script as root on every node once the node is configured and passes
# CustomActions.OnNodeConfigured.Args as positional arguments:
#
#   on_node_configured.sh --neuron-release 2.28.1 --shared-env /fsx/envs/neuron-2.28.1
#   on_node_configured.sh --neuron-release 2.34.0 --shared-env /fsx/envs/torchneuron-2.34.0   (TorchNeuron)
#                         [--requirements FILE|s3://URI] [--pip-index URL] [--apt-suite NAME]
#                         [--node-type head|compute] [--env-only] [--skip-hosts-fix] [--dry-run]
#                         [--environment NAME] [--node-settings FILE|s3://URI]
#   on_node_configured.sh --refresh [--dry-run]     (head node, later: the first run's arguments again)
#
# The deployment uploads this script, the requirement file and the node settings to fixed S3 keys, which the
# cluster configuration names: a new version reaches every compute node that boots after the deploy, and the
# head node (which ran the first version once) when `--refresh` runs it again, e.g. through SSM Run Command.
#
# What it does, by node type:
#   head node     apt: python3.X-venv and g++ only. Starts a background unit that builds the shared
#                 Python venv on the shared file system (torch-neuronx, neuronx-cc, neuronx-distributed
#                 pinned to the release, with the cluster's locked requirement set, in one resolver run)
#                 with --env-only, outside ParallelCluster's 2100 s bootstrap limit.
#   --env-only    (head node, later) rebuilds the shared venv when the requirement set changed: the
#                 pipeline runs this from the shipped source before a new run, so a changed lock never
#                 has to change the cluster's configuration (OnNodeConfigured cannot be updated).
#   --bake        (an image build) the pinned Neuron apt packages and driver only (stacks/node_image.py).
#   compute node  apt: Neuron driver, runtime, collectives and tools pinned to the release (skipped when
#                 a baked image already has exactly these versions);
#                 removes the node's own hostname line from /etc/hosts (trn1 multi-NIC fix);
#                 reserves the training jobs' rendezvous ports (net.ipv4.ip_local_reserved_ports).
#   --environment (head and Trainium compute nodes) systemd units publishing CloudWatch metrics with the
#                 pipeline's code: the head node a timer running `monitor cluster` every minute, each
#                 Trainium node a service running `monitor neuron` (see "monitoring" below).
#   login node    nothing (it uses the shared venv).
#   --node-settings  the settings a user may change after the cluster exists (a JSON object, read with
#                 `node_setting KEY`): the Neuron apt key's fingerprint, and where the first node records it.
#   --refresh     (head node) runs again with the arguments its first run recorded (ARGUMENTS_FILE).
#
# Tests source this file and call its functions; main only runs when the file is executed.
# Overridable for tests: OS_RELEASE_FILE, PCLUSTER_CFNCONFIG, HOSTS_FILE, ARGUMENTS_FILE, SYSCTL_DIR.
set -euo pipefail

# =====================================================================================
# Pinned Neuron SDK release. Change these together, never one at a time.
#
# The neuron backend's release (neuronx-distributed on PyTorch/XLA 2.9; trn1 and trn2). The torch-native
# backend's release (TorchNeuron) has a block of its own below; --neuron-release chooses one (select_release).
#
# Neuron 2.28.1 (2026-03-13). Versions from the Neuron release artifacts ("Previous release
# artifacts (Neuron 2.x)", Trn1 packages for 2.28.1), i.e. src/helperscripts/n2-manifest.json
# in github.com/aws-neuron/aws-neuron-sdk. 2.28.1 only changed aws-neuronx-dkms (2.26.5.0 ->
# 2.26.10.0, fix for Linux kernel 6.18) and gpsimd-customop-lib; the pip packages are 2.28.0's.
#
# Why 2.28 and not a newer release: Neuron's notices "Announcing end of support for NxDT and NxD
# Core Training APIs starting with Neuron SDK release 2.29" and "NxDT and NxD Core Training APIs
# are now in maintenance mode starting with Neuron 2.30" tell NxD Core users to stay on Neuron
# 2.28 / PyTorch 2.9; "Neuron no longer supports PyTorch/XLA for training starting with Neuron
# 2.30"; Neuron 2.32 ships no torch-neuronx or neuronx-distributed at all; the native PyTorch
# backend that replaces them targets Trn2/Trn3, not trn1.
# =====================================================================================
NEURON_RELEASE="2.28.1"
# apt packages (Neuron apt repository), compute nodes only.
NEURON_DKMS_VERSION="2.26.10.0"
NEURON_COLLECTIVES_VERSION="2.30.59.0"
NEURON_RUNTIME_LIB_VERSION="2.30.51.0"
NEURON_TOOLS_VERSION="2.28.23.0"
# pip packages (Neuron pip repository), shared venv built on the head node.
NEURON_TORCH_NEURONX_VERSION="2.9.0.2.12.22436"   # PyTorch 2.9 (PyTorch/XLA based)
NEURON_NEURONX_CC_VERSION="2.23.6484.0"
NEURON_NEURONX_DISTRIBUTED_VERSION="0.17.26814"
# Python versions the release's wheels support.
NEURON_PYTHON_VERSIONS="3.10 3.11 3.12"
# =====================================================================================

# =====================================================================================
# Pinned TorchNeuron release: the torch-native backend (Neuron's native PyTorch backend; trn2, trn3).
# Change these together, never one at a time.
#
# Neuron 2.34.0 (2026-11-30). Its release notes name "torch-neuronx 2.13.3.1 and 2.14.3.1 (Neuron 2.34.0
# Release)": the 2.13.3.1 family is the one for PyTorch 2.13, the torch the torch-native lock pins. Neuron 2.34
# is the first release whose wheels are announced for Ubuntu 24.04 (2.33's torch-neuronx 2.13.3.0 wheels were for
# Ubuntu 26.04 only, which ParallelCluster does not run); TorchNeuron supports Python 3.12 to 3.14.
#
# NOT YET PINNED: the versions below are the ones the "Neuron 2.34.0 release artifacts" page lists for Trn2 (the
# apt packages, torch-neuronx's full 2.13.3.1.<build> version, neuronx-cc and nki); they could not be read where
# this block was written. An empty one makes this release refused, here and by the environment file, so a
# torch-native queue never boots on versions nobody chose. Fill in all seven from that page in one change.
# =====================================================================================
TORCHNEURON_RELEASE="2.34.0"
TORCHNEURON_DKMS_VERSION=""
TORCHNEURON_COLLECTIVES_VERSION=""
TORCHNEURON_RUNTIME_LIB_VERSION=""
TORCHNEURON_TOOLS_VERSION=""
TORCHNEURON_TORCH_NEURONX_VERSION=""   # 2.13.3.1.<build>: PyTorch 2.13 (the native backend)
TORCHNEURON_NEURONX_CC_VERSION=""
TORCHNEURON_NKI_VERSION=""
TORCHNEURON_PYTHON_VERSIONS="3.12 3.13 3.14"
# =====================================================================================

# The pins of the release this run installs: the neuron backend's unless --neuron-release names TorchNeuron's.
NEURON_APT_PINS=(
  "aws-neuronx-dkms=${NEURON_DKMS_VERSION}"
  "aws-neuronx-collectives=${NEURON_COLLECTIVES_VERSION}"
  "aws-neuronx-runtime-lib=${NEURON_RUNTIME_LIB_VERSION}"
  "aws-neuronx-tools=${NEURON_TOOLS_VERSION}"
)
NEURON_PIP_PINS=(
  "torch-neuronx==${NEURON_TORCH_NEURONX_VERSION}"
  "neuronx-cc==${NEURON_NEURONX_CC_VERSION}"
  "neuronx-distributed==${NEURON_NEURONX_DISTRIBUTED_VERSION}"
)

DEFAULT_PIP_INDEX="https://pip.repos.neuron.amazonaws.com"
NEURON_APT_URL="https://apt.repos.neuron.amazonaws.com"
NEURON_APT_KEY_URL="${NEURON_APT_URL}/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB"
NEURON_APT_KEYRING="/etc/apt/keyrings/aws-neuron.gpg"
# Same file name as the Neuron setup guide, so an entry made by that guide is replaced, not
# duplicated (two entries for one repository with different Signed-By make apt fail).
NEURON_APT_SOURCE="/etc/apt/sources.list.d/neuron.list"
NEURON_PROFILE_SCRIPT="/etc/profile.d/aws-neuron.sh"

OS_RELEASE_FILE="${OS_RELEASE_FILE:-/etc/os-release}"
PCLUSTER_CFNCONFIG="${PCLUSTER_CFNCONFIG:-/etc/parallelcluster/cfnconfig}"
HOSTS_FILE="${HOSTS_FILE:-/etc/hosts}"

ENV_MARKER=".neuron-env-complete"   # written last into a finished venv
LOCK_TIMEOUT_SECONDS=1200           # the whole bootstrap must finish within 2100 s
APT_LOCK_TIMEOUT_SECONDS=300        # unattended-upgrades may hold the dpkg lock at boot

# Parsed arguments (set by parse_args).
ARG_NEURON_RELEASE=""
ARG_SHARED_ENV=""
ARG_PIP_INDEX="${DEFAULT_PIP_INDEX}"
ARG_REQUIREMENTS=""
ARG_ENV_ONLY=0
ARG_BAKE=0
ARG_APT_SUITE=""
ARG_NODE_TYPE=""
ARG_SKIP_HOSTS_FIX=0
ARG_NEURON_DEVICES=0
ARG_EFA_DEVICES=0
ARG_TRAINIUM_PARTITION=""
ARG_ENVIRONMENT=""
ARG_NODE_SETTINGS=""
DRY_RUN=0

# Detected state.
OS_ID=""
OS_VERSION_ID=""
OS_CODENAME=""
PYTHON_VERSION=""
NODE_TYPE=""
BUILD_DIR_IN_PROGRESS=""

# ----------------------------------------------------------------------------- helpers

log() {
  printf '%s [on_node_configured] %s\n' "$(date -u '+%Y-%m-%dT%H:%M:%SZ')" "$*" >&2
}

die() {
  log "ERROR: $*"
  exit 1
}

usage() {
  cat <<EOF
Usage: on_node_configured.sh --neuron-release X.Y.Z --shared-env DIR [options]

Required:
  --neuron-release X.Y.Z   Neuron SDK release; must equal a release pinned in this script
                           (${NEURON_RELEASE}: neuronx-distributed; ${TORCHNEURON_RELEASE}: TorchNeuron).
  --shared-env DIR         Absolute path of the shared Python venv on the shared file system,
                           e.g. /fsx/envs/neuron-${NEURON_RELEASE}.
Options:
  --pip-index URL          Extra pip index for the Neuron wheels (default ${DEFAULT_PIP_INDEX}).
  --requirements SRC       The cluster's locked requirement file (a path, or an s3:// URI fetched with the
                           AWS CLI), installed with the Neuron packages in one resolver run.
  --env-only               Head node: only (re)build the shared venv when it does not match the release
                           and the requirement file; no apt, no /etc/hosts.
  --bake                   An image build: install the pinned Neuron apt packages and their driver only.
  --apt-suite NAME         Suite of the Neuron apt repository (default: VERSION_CODENAME of the OS).
  --node-type head|compute Skip node type detection from ${PCLUSTER_CFNCONFIG}.
  --skip-hosts-fix         Do not remove the node's hostname line from ${HOSTS_FILE}.
  --neuron-devices N       Neuron devices a Trainium node must show (/dev/neuron*); fewer fails the
                           bootstrap (ParallelCluster replaces the node) and drains it before a job.
  --efa-devices N          EFA devices a Trainium node must show (/sys/class/infiniband/*); likewise.
  --trainium-partition P   The Slurm partition of the Trainium nodes: the head node installs a prolog
                           that checks both counts before every job there.
  --environment NAME       The environment's name: installs the CloudWatch metrics units (head node:
                           a timer, Trainium nodes: a service) reading <mount>/pipeline/site-NAME.yaml,
                           where <mount> is the parent of --shared-env's "envs" folder.
  --node-settings SRC      The node settings (a JSON object; a path, or an s3:// URI fetched with the AWS
                           CLI): the Neuron apt key's fingerprint or where the first node records it.
  --refresh                First argument only: run again with the arguments the head node's first run
                           recorded in ${ARGUMENTS_FILE}; later arguments, such as --dry-run, are
                           added to them.
  --dry-run                Print the apt/pip/system commands instead of running them.
  -h, --help               Show this help.
EOF
}

usage_error() {
  log "ERROR: $*"
  log "Run with --help for usage."
  exit 2
}

# Run a command, or print it with --dry-run.
run() {
  if [[ "${DRY_RUN}" == 1 ]]; then
    local out="DRY-RUN:" arg
    for arg in "$@"; do
      out+=" $(printf '%q' "${arg}")"
    done
    printf '%s\n' "${out}"
  else
    "$@"
  fi
}

# Replace a file with one line of content (printed with --dry-run).
write_file() {
  local path=$1 content=$2 mode=${3:-0644}
  if [[ "${DRY_RUN}" == 1 ]]; then
    printf 'DRY-RUN: write %s: %s\n' "${path}" "${content}"
    return 0
  fi
  local tmp
  tmp=$(mktemp "${path}.XXXXXX")
  printf '%s\n' "${content}" >"${tmp}"
  chmod "${mode}" "${tmp}"
  mv -f "${tmp}" "${path}"
}

apt_get() {
  run env DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=a \
    apt-get -o "DPkg::Lock::Timeout=${APT_LOCK_TIMEOUT_SECONDS}" -y -q "$@"
}

# ----------------------------------------------------------------------------- arguments

# Make the pinned block that --neuron-release names the one this run installs: the rest of the script reads
# NEURON_RELEASE, NEURON_APT_PINS, NEURON_PIP_PINS and NEURON_PYTHON_VERSIONS only.
select_release() {
  local release=$1
  case "${release}" in
    "${NEURON_RELEASE}") ;;
    "${TORCHNEURON_RELEASE}")
      local variable unpinned=()
      for variable in TORCHNEURON_DKMS_VERSION TORCHNEURON_COLLECTIVES_VERSION TORCHNEURON_RUNTIME_LIB_VERSION \
        TORCHNEURON_TOOLS_VERSION TORCHNEURON_TORCH_NEURONX_VERSION TORCHNEURON_NEURONX_CC_VERSION \
        TORCHNEURON_NKI_VERSION; do
        [[ -n "${!variable}" ]] || unpinned+=("${variable}")
      done
      if ((${#unpinned[@]} > 0)); then
        usage_error "the TorchNeuron release ${TORCHNEURON_RELEASE} is not pinned in this script yet (empty:" \
          "${unpinned[*]}); fill in its versions from Neuron's release artifacts page, or use the neuronx-distributed" \
          "release ${NEURON_RELEASE}"
      fi
      NEURON_RELEASE=${TORCHNEURON_RELEASE}
      NEURON_APT_PINS=(
        "aws-neuronx-dkms=${TORCHNEURON_DKMS_VERSION}"
        "aws-neuronx-collectives=${TORCHNEURON_COLLECTIVES_VERSION}"
        "aws-neuronx-runtime-lib=${TORCHNEURON_RUNTIME_LIB_VERSION}"
        "aws-neuronx-tools=${TORCHNEURON_TOOLS_VERSION}"
      )
      NEURON_PIP_PINS=(
        "torch-neuronx==${TORCHNEURON_TORCH_NEURONX_VERSION}"
        "neuronx-cc==${TORCHNEURON_NEURONX_CC_VERSION}"
        "nki==${TORCHNEURON_NKI_VERSION}"
      )
      NEURON_PYTHON_VERSIONS=${TORCHNEURON_PYTHON_VERSIONS}
      ;;
    *)
      usage_error "--neuron-release ${release} does not match a release pinned in this script" \
        "(${NEURON_RELEASE}: neuronx-distributed; ${TORCHNEURON_RELEASE}: TorchNeuron); update the pinned block" \
        "and the cluster arguments together"
      ;;
  esac
}

set_option() {
  local name=$1 value=$2
  [[ -n "${value}" ]] || usage_error "${name} requires a non-empty value"
  case "${name}" in
    --neuron-release) ARG_NEURON_RELEASE=${value} ;;
    --shared-env) ARG_SHARED_ENV=${value} ;;
    --pip-index) ARG_PIP_INDEX=${value} ;;
    --requirements) ARG_REQUIREMENTS=${value} ;;
    --neuron-devices) ARG_NEURON_DEVICES=${value} ;;
    --efa-devices) ARG_EFA_DEVICES=${value} ;;
    --trainium-partition) ARG_TRAINIUM_PARTITION=${value} ;;
    --environment) ARG_ENVIRONMENT=${value} ;;
    --node-settings) ARG_NODE_SETTINGS=${value} ;;
    --apt-suite) ARG_APT_SUITE=${value} ;;
    --node-type) ARG_NODE_TYPE=${value} ;;
    *) usage_error "unknown argument: '${name}'" ;;
  esac
}

parse_args() {
  while (($# > 0)); do
    case "$1" in
      -h | --help)
        usage
        exit 0
        ;;
      --dry-run)
        DRY_RUN=1
        shift
        ;;
      --skip-hosts-fix)
        ARG_SKIP_HOSTS_FIX=1
        shift
        ;;
      --env-only)
        ARG_ENV_ONLY=1
        shift
        ;;
      --bake)
        ARG_BAKE=1
        shift
        ;;
      --refresh)
        usage_error "--refresh must be the first argument (it replaces the others by the recorded ones)"
        ;;
      --neuron-release | --shared-env | --pip-index | --requirements | --apt-suite | --node-type | \
        --neuron-devices | --efa-devices | --trainium-partition | --environment | --node-settings)
        if (($# < 2)) || [[ "$2" == --* ]]; then
          usage_error "$1 requires a value"
        fi
        set_option "$1" "$2"
        shift 2
        ;;
      --*=*)
        set_option "${1%%=*}" "${1#*=}"
        shift
        ;;
      *)
        usage_error "unknown argument: '$1'"
        ;;
    esac
  done
  validate_args
}

validate_args() {
  [[ -n "${ARG_NEURON_RELEASE}" ]] || usage_error "missing required argument --neuron-release"
  [[ -n "${ARG_SHARED_ENV}" ]] || usage_error "missing required argument --shared-env"
  [[ "${ARG_NEURON_RELEASE}" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] ||
    usage_error "--neuron-release must look like X.Y.Z, got '${ARG_NEURON_RELEASE}'"
  select_release "${ARG_NEURON_RELEASE}"
  ARG_SHARED_ENV=${ARG_SHARED_ENV%/}
  [[ "${ARG_SHARED_ENV}" =~ ^/[A-Za-z0-9._/-]+$ ]] ||
    usage_error "--shared-env must be an absolute path of [A-Za-z0-9._/-], got '${ARG_SHARED_ENV}'"
  [[ "$(dirname "${ARG_SHARED_ENV}")" != "/" ]] ||
    usage_error "--shared-env must be below a mount point such as /fsx, got '${ARG_SHARED_ENV}'"
  [[ "/${ARG_SHARED_ENV}/" != */../* && "/${ARG_SHARED_ENV}/" != */./* ]] ||
    usage_error "--shared-env must not contain '.' or '..' components, got '${ARG_SHARED_ENV}'"
  [[ "${ARG_PIP_INDEX}" =~ ^https?://[^[:space:]]+$ ]] ||
    usage_error "--pip-index must be an http(s) URL, got '${ARG_PIP_INDEX}'"
  if [[ -n "${ARG_APT_SUITE}" && ! "${ARG_APT_SUITE}" =~ ^[a-z]+$ ]]; then
    usage_error "--apt-suite must be a lowercase codename such as jammy, got '${ARG_APT_SUITE}'"
  fi
  case "${ARG_NODE_TYPE}" in
    "" | head | compute | cpu) ;;
    *) usage_error "--node-type must be 'head', 'compute' or 'cpu', got '${ARG_NODE_TYPE}'" ;;
  esac
  [[ "${ARG_NEURON_DEVICES}" =~ ^[0-9]+$ && "${ARG_EFA_DEVICES}" =~ ^[0-9]+$ ]] ||
    usage_error "--neuron-devices and --efa-devices must be counts, got '${ARG_NEURON_DEVICES}', '${ARG_EFA_DEVICES}'"
  [[ -z "${ARG_TRAINIUM_PARTITION}" || "${ARG_TRAINIUM_PARTITION}" =~ ^[a-z][a-z0-9-]*$ ]] ||
    usage_error "--trainium-partition must be a queue name, got '${ARG_TRAINIUM_PARTITION}'"
  if [[ -n "${ARG_ENVIRONMENT}" ]]; then
    [[ "${ARG_ENVIRONMENT}" =~ ^[a-z0-9][a-z0-9-]*$ ]] ||
      usage_error "--environment must be an environment name (lowercase letters, digits, '-'), got '${ARG_ENVIRONMENT}'"
    [[ "$(basename "$(dirname "${ARG_SHARED_ENV}")")" == envs && "$(dirname "$(dirname "${ARG_SHARED_ENV}")")" != / ]] ||
      usage_error "--environment needs --shared-env of the form <mount>/envs/NAME (the mount holds pipeline/)," \
        "got '${ARG_SHARED_ENV}'"
  fi
  if [[ -n "${ARG_REQUIREMENTS}" && ! "${ARG_REQUIREMENTS}" =~ ^(s3://[a-z0-9.-]+/|/)[A-Za-z0-9._/-]+$ ]]; then
    usage_error "--requirements must be an absolute path or an s3:// URI, got '${ARG_REQUIREMENTS}'"
  fi
  if [[ -n "${ARG_NODE_SETTINGS}" && ! "${ARG_NODE_SETTINGS}" =~ ^(s3://[a-z0-9.-]+/|/)[A-Za-z0-9._/-]+$ ]]; then
    usage_error "--node-settings must be an absolute path or an s3:// URI, got '${ARG_NODE_SETTINGS}'"
  fi
  if [[ "${ARG_ENV_ONLY}" == 1 && "${ARG_NODE_TYPE}" != head ]]; then
    usage_error "--env-only builds the shared venv, which only the head node does: add --node-type head"
  fi
}

# ----------------------------------------------------------------------------- detection

# Value of KEY in an os-release style file (quotes removed), empty if absent.
os_release_value() {
  local key=$1 line
  line=$(grep -E "^${key}=" "${OS_RELEASE_FILE}" | tail -n 1) || true
  line=${line#*=}
  line=${line#[\"\']}
  line=${line%[\"\']}
  printf '%s' "${line}"
}

detect_os() {
  [[ -r "${OS_RELEASE_FILE}" ]] || die "cannot read ${OS_RELEASE_FILE} to detect the OS"
  OS_ID=$(os_release_value ID)
  OS_VERSION_ID=$(os_release_value VERSION_ID)
  OS_CODENAME=$(os_release_value VERSION_CODENAME)
  local default_codename
  case "${OS_ID}:${OS_VERSION_ID}" in
    ubuntu:22.04)
      PYTHON_VERSION="3.10"
      default_codename="jammy"
      ;;
    ubuntu:24.04)
      PYTHON_VERSION="3.12"
      default_codename="noble"
      ;;
    *)
      die "unsupported OS '${OS_ID:-unknown} ${OS_VERSION_ID:-unknown}' (from ${OS_RELEASE_FILE}):" \
        "this script supports only Ubuntu 22.04 and 24.04 (ParallelCluster Image.Os ubuntu2204," \
        "ubuntu2404)"
      ;;
  esac
  OS_CODENAME=${OS_CODENAME:-${default_codename}}
  case " ${NEURON_PYTHON_VERSIONS} " in
    *" ${PYTHON_VERSION} "*) ;;
    *) die "Python ${PYTHON_VERSION} of ${OS_ID} ${OS_VERSION_ID} is not supported by Neuron" \
      "${NEURON_RELEASE} (supported: ${NEURON_PYTHON_VERSIONS})" ;;
  esac
}

# head, compute or login. ParallelCluster writes cfn_node_type (HeadNode, ComputeFleet, LoginNode;
# MasterServer before 3.0) into /etc/parallelcluster/cfnconfig before custom actions run. AWS
# documents that file as internal, so --node-type takes precedence when given.
detect_node_type() {
  if [[ -n "${ARG_NODE_TYPE}" ]]; then
    NODE_TYPE=${ARG_NODE_TYPE}
    return 0
  fi
  [[ -r "${PCLUSTER_CFNCONFIG}" ]] ||
    die "cannot detect the node type: ${PCLUSTER_CFNCONFIG} is not readable (not a ParallelCluster" \
      "node?); pass --node-type head|compute"
  local raw
  raw=$(sed -n 's/^cfn_node_type=//p' "${PCLUSTER_CFNCONFIG}" | tail -n 1)
  raw=${raw#[\"\']}
  raw=${raw%[\"\']}
  case "${raw}" in
    HeadNode | MasterServer) NODE_TYPE="head" ;;
    ComputeFleet) NODE_TYPE="compute" ;;
    LoginNode) NODE_TYPE="login" ;;
    "") die "no cfn_node_type in ${PCLUSTER_CFNCONFIG}; pass --node-type head|compute" ;;
    *) die "unknown cfn_node_type '${raw}' in ${PCLUSTER_CFNCONFIG}; pass --node-type head|compute" ;;
  esac
}

require_root() {
  [[ "${EUID}" -eq 0 ]] || die "must run as root (ParallelCluster runs custom actions as root)"
}

# ----------------------------------------------------------------------------- /etc/hosts

# Trainium instances have several network interfaces (trn1.32xlarge 8, trn2.48xlarge 16) and the line
# that maps the node's own hostname can point at the IP of a secondary interface. Removing it lets the name resolve through DNS
# (ParallelCluster's Route 53 zone by default). Removes the given names (default: this host's
# short and full hostname, and any FQDN starting with "<short>.") from every line of HOSTS_FILE;
# a line left without names is dropped. All other lines are kept byte for byte. Idempotent.
fix_etc_hosts() {
  local hosts_file=${HOSTS_FILE} names=("$@") name
  if ((${#names[@]} == 0)); then
    names=("$(hostname -s)" "$(hostname)")
  fi
  local unique=()
  for name in "${names[@]}"; do
    case "${name}" in
      "" | localhost | localhost.* | ip6-*)
        log "WARNING: refusing to remove '${name}' from ${hosts_file}"
        continue
        ;;
    esac
    case " ${unique[*]} " in
      *" ${name} "*) ;;
      *) unique+=("${name}") ;;
    esac
  done
  if ((${#unique[@]} == 0)); then
    log "WARNING: no usable hostname; ${hosts_file} left unchanged"
    return 0
  fi
  names=("${unique[@]}")
  [[ -f "${hosts_file}" ]] || die "hosts file ${hosts_file} does not exist"

  local tmp
  tmp=$(mktemp)
  awk -v names="${names[*]}" '
    BEGIN {
      n = split(names, list, " ")
      for (i = 1; i <= n; i++) { drop[list[i]] = 1; short = list[i]; sub(/\..*/, "", short); drop_prefix[short "."] = 1 }
    }
    function is_self(h,   p) {
      if (h in drop) return 1
      for (p in drop_prefix) if (index(h, p) == 1) return 1
      return 0
    }
    /^[[:space:]]*(#|$)/ { print; next }
    {
      kept = ""; removed = 0; comment = ""
      for (i = 2; i <= NF; i++) {
        if (substr($i, 1, 1) == "#") { for (j = i; j <= NF; j++) comment = comment " " $j; break }
        if (is_self($i)) removed++; else kept = kept " " $i
      }
      if (removed == 0) print
      else if (kept != "") print $1 kept comment
    }
  ' "${hosts_file}" >"${tmp}"

  if cmp -s "${hosts_file}" "${tmp}"; then
    log "${hosts_file}: no line maps ${names[*]}; nothing to change"
    rm -f "${tmp}"
    return 0
  fi
  if [[ "${DRY_RUN}" == 1 ]]; then
    local line
    while IFS= read -r line; do
      case "${line}" in
        "< "*) printf 'DRY-RUN: %s: remove line: %s\n' "${hosts_file}" "${line#< }" ;;
        "> "*) printf 'DRY-RUN: %s: keep as: %s\n' "${hosts_file}" "${line#> }" ;;
      esac
    done < <(diff "${hosts_file}" "${tmp}" || true)
    rm -f "${tmp}"
    return 0
  fi
  # Keep the inode and permissions of the original file (it may be bind-mounted).
  cat "${tmp}" >"${hosts_file}"
  rm -f "${tmp}"
  log "${hosts_file}: removed the lines mapping ${names[*]}"
}

# ----------------------------------------------------------------------------- rendezvous ports

# torchrun's rendezvous ports: the pipeline's distributed jobs listen on one of them (MASTER_PORT, chosen by the job
# id). They lie below Linux's ephemeral ports (net.ipv4.ip_local_port_range, 32768-60999 by default) and are
# reserved as well, as neuronx-distributed's launchers reserve their 44000, so that no outgoing connection of the
# node can hold one when a job starts, even where the ephemeral range was widened. The same range as
# training.pipeline.scripts.RENDEZVOUS_PORTS (a test holds them equal).
RENDEZVOUS_PORTS="31000-31099"
RESERVED_PORTS_KEY="net.ipv4.ip_local_reserved_ports"
SYSCTL_DIR="${SYSCTL_DIR:-/etc/sysctl.d}"
RESERVED_PORTS_FILE="90-trainium-rendezvous-ports.conf"

# Reserve RENDEZVOUS_PORTS now (sysctl -w) and at every boot (a drop-in of /etc/sysctl.d), keeping any ports
# reserved already. A failure is logged, not fatal: the ports are outside the ephemeral range anyway.
reserve_rendezvous_ports() {
  local current value
  current=$(sysctl -n "${RESERVED_PORTS_KEY}" 2>/dev/null) || current=""
  case ",${current}," in
    *",${RENDEZVOUS_PORTS},"*) value=${current} ;;
    *) value="${current:+${current},}${RENDEZVOUS_PORTS}" ;;
  esac
  if [[ "${DRY_RUN}" != 1 ]]; then
    install -d -m 0755 "${SYSCTL_DIR}"
  fi
  write_file "${SYSCTL_DIR}/${RESERVED_PORTS_FILE}" "${RESERVED_PORTS_KEY} = ${value}"
  if run sysctl -q -w "${RESERVED_PORTS_KEY}=${value}"; then
    log "reserved the rendezvous ports ${RENDEZVOUS_PORTS} (${RESERVED_PORTS_KEY} = ${value})"
  else
    log "WARNING: could not reserve the rendezvous ports ${RENDEZVOUS_PORTS}; ${SYSCTL_DIR}/${RESERVED_PORTS_FILE}" \
      "reserves them at the next boot"
  fi
}

# ----------------------------------------------------------------------------- bootstrap end

# The epoch second this node's bootstrap ended, for the run's timeline (training/pipeline/timeline.py reads it in
# every job as the node's "bootstrap end"; the same path as its BOOTSTRAP_END_FILE, a test holds them equal).
BOOTSTRAP_END_FILE="${BOOTSTRAP_END_FILE:-/var/lib/trainium-bootstrap/configured}"

record_bootstrap_end() {
  if [[ "${DRY_RUN}" != 1 ]]; then
    install -d -m 0755 "$(dirname "${BOOTSTRAP_END_FILE}")"
  fi
  write_file "${BOOTSTRAP_END_FILE}" "$(date +%s)" 0644
}

# ----------------------------------------------------------------------------- node settings

# Settings a user may change after the cluster exists (environments/NAME.yaml), in a JSON object that the
# deployment writes to a fixed key and every node reads when it boots: changing one changes that file, never the
# cluster configuration (which ParallelCluster cannot update for the head node's bootstrap).
NODE_SETTINGS_FILE=""

fetch_node_settings() {
  if [[ -z "${ARG_NODE_SETTINGS}" ]]; then
    NODE_SETTINGS_FILE=""
  elif [[ "${ARG_NODE_SETTINGS}" == s3://* ]]; then
    if [[ "${DRY_RUN}" == 1 ]]; then
      printf 'DRY-RUN: fetch %s\n' "${ARG_NODE_SETTINGS}"
      return 0
    fi
    command -v aws >/dev/null || die "the AWS CLI is required to fetch ${ARG_NODE_SETTINGS}"
    NODE_SETTINGS_FILE=$(mktemp "${TMPDIR:-/tmp}/node-settings.XXXXXX")
    aws s3 cp --only-show-errors "${ARG_NODE_SETTINGS}" "${NODE_SETTINGS_FILE}" ||
      die "cannot download ${ARG_NODE_SETTINGS} (does the node role allow s3:GetObject on it?)"
  else
    [[ -f "${ARG_NODE_SETTINGS}" ]] || die "--node-settings ${ARG_NODE_SETTINGS}: no such file"
    NODE_SETTINGS_FILE=${ARG_NODE_SETTINGS}
  fi
  if [[ -n "${NODE_SETTINGS_FILE}" ]]; then
    node_setting neuron_apt_key_record >/dev/null
  fi
}

# The value of KEY in the node settings; nothing when it is absent or null, or when there are no settings. A
# file that is not a JSON object, or a value that is not a string, number or boolean, stops the bootstrap.
node_setting() {
  local key=$1 out
  [[ -n "${NODE_SETTINGS_FILE}" ]] || return 0
  out=$(python3 - "${NODE_SETTINGS_FILE}" "${key}" <<'PY'
import json
import sys

path, key = sys.argv[1:]
try:
    with open(path, encoding="utf-8") as handle:
        settings = json.load(handle)
except (OSError, ValueError) as error:
    print(f"node settings {path}: not a readable JSON file ({error})")
    sys.exit(3)
if not isinstance(settings, dict):
    print(f"node settings {path}: a JSON object is required")
    sys.exit(3)
value = settings.get(key)
if isinstance(value, (dict, list)):
    print(f"node settings {path}: {key} must be a string, a number or a boolean")
    sys.exit(3)
if value is not None:
    print(str(value).lower() if isinstance(value, bool) else value, end="")
PY
  ) || die "${out}"
  printf '%s' "${out}"
}

# ----------------------------------------------------------------------------- Neuron apt key

# The Neuron apt key is downloaded over TLS from the repository it signs; nothing on a node says which key is the
# right one. So the key is pinned on first use: the first Trainium node records the fingerprint of the
# key it downloaded in the bucket, with a conditional write that fails when the record exists (the node role may
# only write it that way, and may not delete it), and every later node refuses a key with another fingerprint. A
# fingerprint in the environment file (node setting neuron_apt_key_fingerprint) takes precedence over the record.

# The fingerprints of the primary keys in FILE (armored or binary), one a line, from gpg's machine-readable
# listing: each pub record is followed by its fpr record.
apt_key_fingerprints() {
  local file=$1 home listing
  command -v gpg >/dev/null || die "gpg is required to check the Neuron apt key"
  home=$(mktemp -d)
  listing=$(gpg --homedir "${home}" --batch --no-tty --show-keys --with-colons "${file}" 2>/dev/null) || listing=""
  rm -rf -- "${home}"
  awk -F: '$1 == "pub" { primary = 1; next } primary && $1 == "fpr" { print toupper($10); primary = 0 }' \
    <<<"${listing}"
}

# The fingerprint recorded at the s3:// URI, or nothing when no node has recorded one yet.
read_key_record() {
  local uri=$1 file error
  file=$(mktemp)
  if error=$(aws s3 cp --only-show-errors "${uri}" "${file}" 2>&1); then
    tr -d '[:space:]' <"${file}" | tr '[:lower:]' '[:upper:]'
    rm -f -- "${file}"
    return 0
  fi
  rm -f -- "${file}"
  case "${error}" in
    *"(404)"* | *NoSuchKey* | *"Not Found"*) return 0 ;;
  esac
  die "cannot read ${uri}: ${error//$'\n'/ }"
}

# Record FINGERPRINT at the s3:// URI unless an object is there already (If-None-Match: *, S3 answers 412).
# Needs an AWS CLI from late 2024 or newer (--if-none-match); the node role allows no other write of the record.
RECORD_RETRY_SECONDS=2
record_key_fingerprint() {
  local uri=$1 fingerprint=$2 path bucket body status=0
  path=${uri#s3://}
  bucket=${path%%/*}
  body=$(mktemp)
  printf '%s\n' "${fingerprint}" >"${body}"
  aws s3api put-object --bucket "${bucket}" --key "${path#*/}" --body "${body}" --content-type text/plain \
    --if-none-match '*' >/dev/null || status=$?
  rm -f -- "${body}"
  return "${status}"
}

# Stop, in one line, unless the key in FILE has the expected fingerprint (see above); before apt trusts it.
check_neuron_apt_key() {
  local file=$1 actual expected origin record error
  local -a found
  mapfile -t found < <(apt_key_fingerprints "${file}")
  ((${#found[@]} == 1)) ||
    die "the Neuron apt key from ${NEURON_APT_KEY_URL} holds ${#found[@]} OpenPGP keys, expected exactly one"
  actual=${found[0]}
  expected=$(node_setting neuron_apt_key_fingerprint) || exit 1
  expected=${expected^^}
  if [[ -n "${expected}" ]]; then
    origin="neuron.apt_key_fingerprint of the environment file"
  else
    record=$(node_setting neuron_apt_key_record) || exit 1
    if [[ -z "${record}" ]]; then
      log "WARNING: the Neuron apt key (fingerprint ${actual}) is not pinned: no node settings name its" \
        "fingerprint or where to record it"
      return 0
    fi
    [[ "${record}" =~ ^s3://[a-z0-9.-]+/[A-Za-z0-9._/-]+$ ]] ||
      die "node setting neuron_apt_key_record must be an s3:// URI, got '${record}'"
    local attempt
    for attempt in 1 2 3; do
      expected=$(read_key_record "${record}") || exit 1
      [[ -z "${expected}" ]] || break
      if error=$(record_key_fingerprint "${record}" "${actual}" 2>&1); then
        log "first use: recorded the Neuron apt key's fingerprint ${actual} at ${record}"
        return 0
      fi
      # Another node recorded first (412 Precondition Failed) or is recording now (409
      # ConditionalRequestConflict), or the write failed: what the record holds decides.
      ((attempt == 3)) || sleep "${RECORD_RETRY_SECONDS}"
    done
    [[ -n "${expected}" ]] ||
      die "cannot record the Neuron apt key's fingerprint at ${record}: ${error//$'\n'/ }"
    origin="recorded at ${record} by the first node"
  fi
  [[ "${expected}" =~ ^[0-9A-F]{40}$ ]] ||
    die "the expected Neuron apt key fingerprint (${origin}) is not 40 hexadecimal digits: '${expected}'"
  [[ "${actual}" == "${expected}" ]] ||
    die "refusing the Neuron apt key from ${NEURON_APT_KEY_URL}: its fingerprint is ${actual}, not ${expected}" \
      "(${origin})"
  log "the Neuron apt key's fingerprint ${actual} is the expected one (${origin})"
}

# ----------------------------------------------------------------------------- compute node

configure_neuron_apt_repo() {
  local suite=${ARG_APT_SUITE:-${OS_CODENAME}}
  log "configuring the Neuron apt repository (${NEURON_APT_URL} ${suite})"
  run install -d -m 0755 "$(dirname "${NEURON_APT_KEYRING}")"
  if [[ "${DRY_RUN}" == 1 ]]; then
    printf 'DRY-RUN: fetch %s into %s\n' "${NEURON_APT_KEY_URL}" "${NEURON_APT_KEYRING}"
    printf 'DRY-RUN: check its fingerprint against the node setting or the first node'"'"'s record\n'
  else
    command -v curl >/dev/null || die "curl is required to fetch the Neuron apt key"
    local key
    key=$(mktemp)
    curl -fsSL --retry 5 --retry-delay 3 --max-time 60 -o "${key}" "${NEURON_APT_KEY_URL}" ||
      die "cannot download ${NEURON_APT_KEY_URL}"
    check_neuron_apt_key "${key}"
    if grep -q -- '-----BEGIN PGP PUBLIC KEY BLOCK-----' "${key}"; then
      command -v gpg >/dev/null || die "gpg is required to convert the Neuron apt key"
      gpg --batch --yes --dearmor -o "${NEURON_APT_KEYRING}" "${key}"
    else
      install -m 0644 "${key}" "${NEURON_APT_KEYRING}"
    fi
    chmod 0644 "${NEURON_APT_KEYRING}"
    rm -f "${key}"
  fi
  write_file "${NEURON_APT_SOURCE}" \
    "deb [signed-by=${NEURON_APT_KEYRING}] ${NEURON_APT_URL} ${suite} main"
}

# The Neuron driver is built by DKMS against the running kernel, hence the matching headers.
# Versions are pinned with a trailing '*' because the runtime and collectives debs carry a build
# suffix (for example 2.30.51.0-<hash>); the packages are held so unattended upgrades cannot move
# the driver away from the runtime of this release.
# Whether every pinned Neuron apt package is installed at its pinned version: a node booted from a baked
# image (`--bake`, stacks/node_image.py) has them, and its driver built for the image's kernel.
DPKG_QUERY="${DPKG_QUERY:-dpkg-query}"
neuron_packages_installed() {
  local pin name version installed
  for pin in "${NEURON_APT_PINS[@]}"; do
    name=${pin%%=*}
    version=${pin#*=}
    # shellcheck disable=SC2016 # ${Version} is dpkg-query's field name, not a shell expansion
    installed=$("${DPKG_QUERY}" -W -f='${Version}' "${name}" 2>/dev/null) || return 1
    [[ "${installed}" == "${version}"* ]] || return 1
  done
}

install_compute_packages() {
  local pins=() pin names=()
  if neuron_packages_installed; then
    log "Neuron ${NEURON_RELEASE} apt packages already installed (a baked image): no apt, no driver build"
    run modprobe neuron
    return 0
  fi
  for pin in "${NEURON_APT_PINS[@]}"; do
    pins+=("${pin}*")
    names+=("${pin%%=*}")
  done
  log "installing Neuron ${NEURON_RELEASE} apt packages: ${NEURON_APT_PINS[*]}"
  apt_get update
  apt_get install --no-install-recommends --allow-downgrades --allow-change-held-packages \
    "linux-headers-$(uname -r)" "${pins[@]}"
  run apt-mark hold "${names[@]}"
  if [[ "${NEURON_BAKING:-0}" == 1 ]]; then
    return 0  # the image build instance has no Neuron devices; nodes booted from it load the driver
  fi
  run modprobe neuron
  # shellcheck disable=SC2016 # ${PATH} is meant to expand at login, not here
  write_file "${NEURON_PROFILE_SCRIPT}" 'export PATH="/opt/aws/neuron/bin:${PATH}"'
}

# ----------------------------------------------------------------------------- node health

DEVICE_ROOT="${DEVICE_ROOT:-}"   # a fake device tree in tests
SLURM_BIN="${SLURM_BIN:-/opt/slurm/bin}"
# ParallelCluster (3.6+) runs every file of this directory as the Slurm prolog, on the compute node, as
# root; /opt/slurm is shared from the head node, so the head node installs it once for all nodes.
HEALTH_PROLOG="${HEALTH_PROLOG:-/opt/slurm/etc/scripts/prolog.d/80_trainium_node_health}"

# What is wrong with this node's devices, or nothing: the same test as the prolog's.
device_problem() {
  local problem="" restore
  local -a neuron efa
  restore=$(shopt -p nullglob)
  shopt -s nullglob
  neuron=("${DEVICE_ROOT}"/dev/neuron[0-9]*)
  efa=("${DEVICE_ROOT}"/sys/class/infiniband/*)
  eval "${restore}"
  ((${#neuron[@]} >= ARG_NEURON_DEVICES)) || problem="${#neuron[@]} of ${ARG_NEURON_DEVICES} Neuron devices"
  ((${#efa[@]} >= ARG_EFA_DEVICES)) || problem="${problem:+${problem}, }${#efa[@]} of ${ARG_EFA_DEVICES} EFA devices"
  printf '%s' "${problem}"
}

# A Trainium node without all its devices cannot train: fail the bootstrap, so ParallelCluster replaces it.
check_devices() {
  if [[ "${DRY_RUN}" == 1 ]]; then
    log "would check for ${ARG_NEURON_DEVICES} Neuron and ${ARG_EFA_DEVICES} EFA devices"
    return 0
  fi
  local problem
  problem=$(device_problem)
  [[ -z "${problem}" ]] || die "node health: ${problem} (the instance is faulty or not a Trainium type)"
  log "node health: ${ARG_NEURON_DEVICES} Neuron and ${ARG_EFA_DEVICES} EFA devices present"
}

# The prolog: before each job on the Trainium partition, the same device test; a node that fails it is
# drained with the reason (Slurm then requeues the job elsewhere) instead of failing the job's collectives.
write_health_prolog() {
  local target=${HEALTH_PROLOG}
  if [[ -z "${ARG_TRAINIUM_PARTITION}" ]]; then
    return 0
  fi
  if [[ "${DRY_RUN}" == 1 ]]; then
    printf 'DRY-RUN: write %s\n' "${target}"
    return 0
  fi
  install -d -m 0755 "$(dirname "${target}")"
  local tmp
  tmp=$(mktemp "${target}.XXXXXX")
  cat >"${tmp}" <<PROLOG
#!/bin/bash
# Written by on_node_configured.sh (Neuron ${NEURON_RELEASE}): Trainium node health before each job.
[[ "\${SLURM_JOB_PARTITION:-}" == "${ARG_TRAINIUM_PARTITION}" ]] || exit 0
# Slurm runs prologs without PATH: builtins and absolute paths only.
shopt -s nullglob
root="\${DEVICE_ROOT:-}"
neuron_devices=("\${root}"/dev/neuron[0-9]*)
efa_devices=("\${root}"/sys/class/infiniband/*)
neuron=\${#neuron_devices[@]}
efa=\${#efa_devices[@]}
problem=""
((neuron >= ${ARG_NEURON_DEVICES})) || problem="\${neuron} of ${ARG_NEURON_DEVICES} Neuron devices"
((efa >= ${ARG_EFA_DEVICES})) || problem="\${problem:+\${problem}, }\${efa} of ${ARG_EFA_DEVICES} EFA devices"
[[ -z "\${problem}" ]] && exit 0
echo "trainium node health: \${problem}" >&2
${SLURM_BIN}/scontrol update NodeName="\${SLURMD_NODENAME}" State=DRAIN Reason="trainium node health: \${problem}"
exit 1
PROLOG
  chmod 0755 "${tmp}"
  mv -f "${tmp}" "${target}"
  log "installed the node health prolog ${target} for partition ${ARG_TRAINIUM_PARTITION}"
}

check_shared_env_visible() {
  if [[ -x "${ARG_SHARED_ENV}/bin/python" && -f "${ARG_SHARED_ENV}/${ENV_MARKER}" ]]; then
    log "shared venv ${ARG_SHARED_ENV} is present"
  else
    log "WARNING: shared venv ${ARG_SHARED_ENV} is not (yet) complete; the head node builds it"
  fi
}

# ----------------------------------------------------------------------------- head node

# The head node has no Neuron devices, so it gets no Neuron apt packages: no driver (DKMS would
# build a module that can never load), no runtime/collectives (nothing executes on a NeuronCore
# there) and no aws-neuronx-tools (neuron-ls/neuron-top need devices). The compiler (neuronx-cc)
# and neuron_parallel_compile come with the pip packages of the shared venv, and compilation runs
# inside Slurm jobs on the compute nodes. The head node only needs to create that venv.
install_head_packages() {
  log "installing python${PYTHON_VERSION}-venv and g++ to build the shared venv"
  apt_get update
  apt_get install --no-install-recommends "python${PYTHON_VERSION}-venv" g++
}

# Complete for this release and, when given, this requirement file (by content, not by name).
shared_env_complete() {
  local dir=$1 wanted=${2:-}
  [[ -x "${dir}/bin/python" && -f "${dir}/${ENV_MARKER}" ]] &&
    grep -qx "neuron_release=${NEURON_RELEASE}" "${dir}/${ENV_MARKER}" &&
    grep -qxF "requirements_sha256=${wanted}" "${dir}/${ENV_MARKER}"
}

# The requirement file as a local path: fetched once into a temporary file when it is an s3:// URI.
REQUIREMENTS_FILE=""
fetch_requirements() {
  if [[ -z "${ARG_REQUIREMENTS}" ]]; then
    REQUIREMENTS_FILE=""
  elif [[ "${ARG_REQUIREMENTS}" == s3://* ]]; then
    REQUIREMENTS_FILE=$(mktemp "${TMPDIR:-/tmp}/cluster-requirements.XXXXXX")
    if [[ "${DRY_RUN}" == 1 ]]; then
      printf 'DRY-RUN: fetch %s into %s\n' "${ARG_REQUIREMENTS}" "${REQUIREMENTS_FILE}"
      printf '# dry run\n' >"${REQUIREMENTS_FILE}"
    else
      command -v aws >/dev/null || die "the AWS CLI is required to fetch ${ARG_REQUIREMENTS}"
      aws s3 cp --only-show-errors "${ARG_REQUIREMENTS}" "${REQUIREMENTS_FILE}" ||
        die "cannot download ${ARG_REQUIREMENTS} (does the node role allow s3:GetObject on it?)"
    fi
  else
    [[ -f "${ARG_REQUIREMENTS}" ]] || die "--requirements ${ARG_REQUIREMENTS}: no such file"
    REQUIREMENTS_FILE=${ARG_REQUIREMENTS}
  fi
}

requirements_digest() {
  if [[ -n "${REQUIREMENTS_FILE}" ]]; then
    sha256sum "${REQUIREMENTS_FILE}" | cut -d' ' -f1
  fi
}

# Fail unless the installed versions equal the pins (pip must not have picked anything else, e.g.
# the placeholder packages of the same names on PyPI). A local version label is ignored, as pip
# does for '==': Neuron wheels such as neuronx-cc carry one (2.x.y.z+<hash>).
verify_pip_versions() {
  local python=$1
  "${python}" - "${NEURON_PIP_PINS[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

wrong = []
for pin in sys.argv[1:]:
    name, wanted = pin.split("==")
    try:
        found = version(name)
    except PackageNotFoundError:
        found = "not installed"
    if found.split("+", 1)[0] != wanted:
        wrong.append(f"{name}: wanted {wanted}, found {found}")
if wrong:
    sys.exit("pinned Neuron packages mismatch: " + "; ".join(wrong))
PY
}

# One resolver run for the Neuron pins and the requirement file: pip either finds one consistent set
# or fails here, instead of a second install quietly moving a package the first one chose.
install_pip_packages() {
  local python=$1
  local pip=("${python}" -m pip install --no-cache-dir --disable-pip-version-check --timeout 60 --retries 5)
  local requirements=()
  if [[ -n "${REQUIREMENTS_FILE}" ]]; then
    requirements=(-r "${REQUIREMENTS_FILE}")
  fi
  run "${pip[@]}" --upgrade pip
  run "${pip[@]}" --extra-index-url "${ARG_PIP_INDEX}" "${NEURON_PIP_PINS[@]}" "${requirements[@]}"
}

# Remove venv builds that an interrupted run left behind. Caller holds the lock. The directory
# the symlink currently points at is kept: jobs may still be using it.
remove_stale_builds() {
  local parent=$1 name=$2 dir current
  current=$(readlink "${parent}/${name}" 2>/dev/null) || current=""
  for dir in "${parent}/.${name}.env-"*; do
    [[ -d "${dir}" ]] || continue
    [[ "$(basename "${dir}")" != "${current}" ]] || continue
    log "removing stale build ${dir}"
    rm -rf -- "${dir}"
  done
}

# Build the shared venv once. A venv cannot be renamed after pip has run (scripts in bin/ and
# bin/activate hold its absolute path), so it is built in a hidden sibling directory that keeps
# its name, and is published by atomically renaming a symlink onto --shared-env as the very last
# step. An interrupted build therefore never appears at --shared-env, and the next run removes it.
# A lock file next to it (flock; ParallelCluster mounts FSx for Lustre with -o flock) serialises
# concurrent or repeated runs.
build_shared_env() {
  local target=${ARG_SHARED_ENV}
  local parent name
  parent=$(dirname "${target}")
  name=$(basename "${target}")
  local lock_file="${parent}/.${name}.lock"
  local digest
  digest=$(requirements_digest)

  if shared_env_complete "${target}" "${digest}"; then
    log "shared venv ${target} is already complete; nothing to do"
    return 0
  fi
  if [[ "${DRY_RUN}" == 1 ]]; then
    local build="${parent}/.${name}.env-XXXXXXXX"
    run mkdir -p "${parent}"
    run flock -w "${LOCK_TIMEOUT_SECONDS}" "${lock_file}"
    run "python${PYTHON_VERSION}" -m venv "${build}"
    install_pip_packages "${build}/bin/python"
    run ln -sfn "$(basename "${build}")" "${target}"
    return 0
  fi

  mkdir -p "${parent}"
  local fs_type
  fs_type=$(stat -f -c %T "${parent}" 2>/dev/null || echo unknown)
  [[ "${fs_type}" == lustre ]] ||
    log "WARNING: ${parent} is on '${fs_type}', not Lustre; compute nodes may not see the venv"

  local lock_fd
  exec {lock_fd}>>"${lock_file}"
  log "waiting for ${lock_file}"
  flock -w "${LOCK_TIMEOUT_SECONDS}" "${lock_fd}" ||
    die "timed out after ${LOCK_TIMEOUT_SECONDS}s waiting for ${lock_file} (another build running?)"

  if shared_env_complete "${target}" "${digest}"; then
    log "shared venv ${target} was completed by another run"
    exec {lock_fd}>&-
    return 0
  fi
  if [[ -L "${target}" ]]; then
    log "shared venv ${target} does not match Neuron ${NEURON_RELEASE} and the requirement file: rebuilding" \
      "(jobs running on the current build keep it)"
  elif [[ -e "${target}" ]]; then
    die "${target} exists but is not a complete venv of Neuron ${NEURON_RELEASE} built by this" \
      "script; remove it or choose another --shared-env"
  fi
  remove_stale_builds "${parent}" "${name}"

  local build
  build=$(mktemp -d "${parent}/.${name}.env-XXXXXXXX")
  BUILD_DIR_IN_PROGRESS=${build}
  chmod 0755 "${build}"
  log "building the shared venv in ${build}"
  "python${PYTHON_VERSION}" -m venv "${build}"
  install_pip_packages "${build}/bin/python"
  verify_pip_versions "${build}/bin/python"
  "${build}/bin/python" -m pip check || log "WARNING: pip check reports dependency problems"
  # Lets later installs into user venvs keep these versions: pip install -c <file> ...
  "${build}/bin/python" -m pip freeze --all >"${build}/neuron-constraints.txt"
  if [[ -n "${REQUIREMENTS_FILE}" ]]; then
    install -m 0644 "${REQUIREMENTS_FILE}" "${build}/cluster-requirements.txt"
  fi
  printf 'neuron_release=%s\nrequirements_sha256=%s\nbuilt=%s\n' "${NEURON_RELEASE}" "${digest}" \
    "$(date -u '+%Y-%m-%dT%H:%M:%SZ')" >"${build}/${ENV_MARKER}"

  local link="${parent}/.${name}.link-$$"
  ln -sfn "$(basename "${build}")" "${link}"
  mv -T -f "${link}" "${target}"
  BUILD_DIR_IN_PROGRESS=""
  exec {lock_fd}>&-
  log "shared venv ready: ${target} -> $(basename "${build}")"
}

# ----------------------------------------------------------------------------- the shared venv, in the background

# The head node's OnNodeConfigured must finish within ParallelCluster's 2100 s (NODE_BOOTSTRAP_TIMEOUT), its
# own cookbook included, and a failure there rolls back the whole first deploy. The shared venv (about 3 GB of
# wheels, 7-8 GB installed) is therefore built by a oneshot unit started in the background: OnNodeConfigured
# returns at once. The pipeline's `--env-only` (before every run) takes the same lock as the build, so it waits
# for a running build and then finds it complete, or builds again and fails the run, never the cluster, with
# pip's error. Jobs see the venv only once it is complete: its path is a link moved into place last.
SHARED_ENV_UNIT="trainium-shared-env.service"
BOOTSTRAP_COPY="${BOOTSTRAP_COPY:-/var/lib/trainium-bootstrap/on_node_configured.sh}"

shared_env_arguments() {
  local -a arguments=(--env-only --node-type head --neuron-release "${ARG_NEURON_RELEASE}"
    --shared-env "${ARG_SHARED_ENV}" --pip-index "${ARG_PIP_INDEX}")
  if [[ -n "${ARG_REQUIREMENTS}" ]]; then
    arguments+=(--requirements "${ARG_REQUIREMENTS}")
  fi
  printf '%s\n' "${arguments[@]}"
}

shared_env_unit_text() {
  local command="/bin/bash ${BOOTSTRAP_COPY}" argument
  while IFS= read -r argument; do
    [[ "${argument}" =~ ^[A-Za-z0-9_./:=@+-]+$ ]] ||
      die "cannot pass '${argument}' to ${SHARED_ENV_UNIT}: allowed: letters, digits and _ . / : = @ + -"
    command+=" ${argument}"
  done < <(shared_env_arguments)
  cat <<UNIT
[Unit]
Description=Build the shared Neuron environment ${ARG_SHARED_ENV} (pipeline runs wait for it)
Wants=network-online.target
After=network-online.target remote-fs.target

[Service]
Type=oneshot
ExecStart=${command}
# pip downloads and installs several GB; the pipeline's own wait is bounded separately.
TimeoutStartSec=3600
UNIT
}

start_shared_env_build() {
  local path="${SYSTEMD_DIR}/${SHARED_ENV_UNIT}"
  if [[ "${DRY_RUN}" == 1 ]]; then
    printf 'DRY-RUN: copy %s to %s\n' "${BASH_SOURCE[0]}" "${BOOTSTRAP_COPY}"
    printf 'DRY-RUN: write %s\n' "${path}"
    shared_env_unit_text | sed -E 's/^(.)/  \1/'
  else
    install -D -m 0700 "${BASH_SOURCE[0]}" "${BOOTSTRAP_COPY}"
    install -d -m 0755 "${SYSTEMD_DIR}"
    local tmp
    tmp=$(mktemp "${path}.XXXXXX")
    shared_env_unit_text >"${tmp}"
    chmod 0644 "${tmp}"
    mv -f "${tmp}" "${path}"
  fi
  run systemctl daemon-reload
  run systemctl start --no-block "${SHARED_ENV_UNIT}"
  log "the shared venv ${ARG_SHARED_ENV} is being built by ${SHARED_ENV_UNIT} (journalctl -u ${SHARED_ENV_UNIT})"
}

# ----------------------------------------------------------------------------- monitoring

# CloudWatch metrics from the nodes (training/monitoring/): the head node's queue, nodes and run stages every
# minute (a timer), each Trainium node's Neuron devices from neuron-monitor (a service). Both run the pipeline's
# code, `<mount>/pipeline/current` (a link the pipeline moves to each source it submits), with the shared venv's
# Python and the pipeline's site file, none of which exists before the pipeline's first submission: until then
# the timer's service fails each minute and the Neuron service restarts every RestartSec.
SYSTEMD_DIR="${SYSTEMD_DIR:-/etc/systemd/system}"
CLUSTER_MONITOR_UNIT="trainium-monitor-cluster"
NEURON_MONITOR_UNIT="trainium-monitor-neuron"

monitor_mount_dir() {
  dirname "$(dirname "${ARG_SHARED_ENV}")"
}

# `monitor cluster|neuron` as the units run it: absolute paths only (a unit has no login PATH).
monitor_command() {
  local target=$1 mount
  mount=$(monitor_mount_dir)
  printf '%s/bin/python -m training monitor %s --site %s/pipeline/site-%s.yaml' \
    "${ARG_SHARED_ENV}" "${target}" "${mount}" "${ARG_ENVIRONMENT}"
}

# The text of one unit file: trainium-monitor-cluster.service, .timer or trainium-monitor-neuron.service.
monitor_unit_text() {
  local unit=$1 mount
  mount=$(monitor_mount_dir)
  local header="# Written by on_node_configured.sh (Neuron ${NEURON_RELEASE}, environment ${ARG_ENVIRONMENT})."
  case "${unit}" in
    "${CLUSTER_MONITOR_UNIT}.service")
      cat <<UNIT
${header}
[Unit]
Description=Trainium ${ARG_ENVIRONMENT}: Slurm jobs and nodes and the newest run's stages to CloudWatch (one pass)
After=network-online.target remote-fs.target
Wants=network-online.target

[Service]
Type=oneshot
Environment=PYTHONPATH=${mount}/pipeline/current
Environment=PYTHONUNBUFFERED=1
ExecStart=$(monitor_command cluster)
TimeoutStartSec=50
Nice=10
UNIT
      ;;
    "${CLUSTER_MONITOR_UNIT}.timer")
      cat <<UNIT
${header}
[Unit]
Description=Trainium ${ARG_ENVIRONMENT}: CloudWatch metrics of the cluster every minute

[Timer]
OnCalendar=minutely
AccuracySec=5s
Unit=${CLUSTER_MONITOR_UNIT}.service

[Install]
WantedBy=timers.target
UNIT
      ;;
    "${NEURON_MONITOR_UNIT}.service")
      cat <<UNIT
${header}
[Unit]
Description=Trainium ${ARG_ENVIRONMENT}: NeuronCore utilisation and device memory to CloudWatch (neuron-monitor)
After=network-online.target remote-fs.target
Wants=network-online.target
StartLimitIntervalSec=0

[Service]
Type=simple
Environment=PYTHONPATH=${mount}/pipeline/current
Environment=PYTHONUNBUFFERED=1
ExecStart=$(monitor_command neuron)
Restart=always
RestartSec=60
PrivateTmp=true
Nice=10

[Install]
WantedBy=multi-user.target
UNIT
      ;;
    *) die "no such monitoring unit: ${unit}" ;;
  esac
}

# Write the units of `monitor cluster` (head node: a oneshot service and the timer that starts it) or `monitor
# neuron` (Trainium node: a service), then enable and start the timer or service. A failure to start is logged,
# not fatal: metrics are not worth replacing a node (or failing the cluster) for.
install_monitoring_units() {
  local target=$1 started unit
  local -a units
  case "${target}" in
    cluster) units=("${CLUSTER_MONITOR_UNIT}.service" "${CLUSTER_MONITOR_UNIT}.timer") ;;
    neuron) units=("${NEURON_MONITOR_UNIT}.service") ;;
    *) die "no such monitor: ${target}" ;;
  esac
  started=${units[-1]}
  if [[ -z "${ARG_ENVIRONMENT}" ]]; then
    log "no --environment: no CloudWatch metrics units"
    return 0
  fi
  for unit in "${units[@]}"; do
    local path="${SYSTEMD_DIR}/${unit}"
    if [[ "${DRY_RUN}" == 1 ]]; then
      printf 'DRY-RUN: write %s\n' "${path}"
      monitor_unit_text "${unit}" | sed -E 's/^(.)/  \1/'
      continue
    fi
    install -d -m 0755 "${SYSTEMD_DIR}"
    local tmp
    tmp=$(mktemp "${path}.XXXXXX")
    monitor_unit_text "${unit}" >"${tmp}"
    chmod 0644 "${tmp}"
    mv -f "${tmp}" "${path}"
  done
  if run systemctl daemon-reload && run systemctl enable --now "${started}"; then
    log "CloudWatch metrics: ${started} enabled: $(monitor_command "${target}")"
  else
    log "WARNING: could not enable ${started}: no CloudWatch metrics from this node"
  fi
}

# ----------------------------------------------------------------------------- --refresh

# The head node's first run records its arguments (root only, on the head node), so `--refresh` can run a newer
# script with exactly the cluster's arguments later: the head node runs OnNodeConfigured once, at creation.
ARGUMENTS_FILE="${ARGUMENTS_FILE:-/var/lib/trainium-bootstrap/arguments}"

record_arguments() {
  install -d -m 0700 "$(dirname "${ARGUMENTS_FILE}")"
  write_file "${ARGUMENTS_FILE}" "$(printf '%s\n' "$@")" 0600
  log "recorded the arguments in ${ARGUMENTS_FILE} (for --refresh)"
}

# ----------------------------------------------------------------------------- main

on_exit() {
  local status=$?
  if [[ "${ARG_REQUIREMENTS}" == s3://* && -n "${REQUIREMENTS_FILE}" ]]; then
    rm -f -- "${REQUIREMENTS_FILE}"
  fi
  if [[ "${ARG_NODE_SETTINGS}" == s3://* && -n "${NODE_SETTINGS_FILE}" ]]; then
    rm -f -- "${NODE_SETTINGS_FILE}"
  fi
  if [[ -n "${BUILD_DIR_IN_PROGRESS}" && -d "${BUILD_DIR_IN_PROGRESS}" ]]; then
    log "removing the unfinished build ${BUILD_DIR_IN_PROGRESS}"
    rm -rf -- "${BUILD_DIR_IN_PROGRESS}"
  fi
  if ((status != 0)); then
    log "FAILED with exit status ${status} after ${SECONDS}s"
  fi
}

main() {
  set -E
  trap 'log "ERROR: command failed (exit $?) at line ${LINENO}: ${BASH_COMMAND}"' ERR
  trap on_exit EXIT
  umask 022
  export HOME="${HOME:-/root}"

  local -a recorded=()
  if [[ "${1:-}" == --refresh ]]; then
    shift
    [[ -r "${ARGUMENTS_FILE}" ]] ||
      usage_error "--refresh: no arguments recorded at ${ARGUMENTS_FILE} (a head node bootstrapped by this" \
        "script's release records them at its first run)"
    mapfile -t recorded <"${ARGUMENTS_FILE}"
    log "--refresh: running with the arguments of the first run: ${recorded[*]} $*"
    set -- "${recorded[@]}" "$@"
  fi
  parse_args "$@"
  detect_os
  detect_node_type
  if [[ "${DRY_RUN}" != 1 ]]; then
    require_root
    if [[ "${NODE_TYPE}" == head && "${ARG_ENV_ONLY}" != 1 && ${#recorded[@]} == 0 ]]; then
      record_arguments "$@"
    fi
  fi
  fetch_node_settings
  local mode="installing"
  if [[ "${DRY_RUN}" == 1 ]]; then
    mode="dry run"
  fi
  log "Neuron ${NEURON_RELEASE}, node type ${NODE_TYPE}, ${OS_ID} ${OS_VERSION_ID} (${OS_CODENAME})," \
    "shared venv ${ARG_SHARED_ENV}, ${mode}"

  if [[ "${ARG_BAKE}" == 1 ]]; then
    # An image build (pcluster build-image, stacks/node_image.py): the pinned Neuron packages and their driver,
    # nothing of a running node (devices, hosts, units, the shared venv).
    log "--bake: installing the Neuron ${NEURON_RELEASE} apt packages into the image"
    configure_neuron_apt_repo
    NEURON_BAKING=1 install_compute_packages
    log "done in ${SECONDS}s"
    return 0
  fi
  case "${NODE_TYPE}" in
    head)
      fetch_requirements
      if [[ "${ARG_ENV_ONLY}" == 1 ]]; then
        log "--env-only: the shared venv only (waits for a build ${SHARED_ENV_UNIT} is running)"
        build_shared_env
      else
        install_head_packages
        write_health_prolog
        install_monitoring_units cluster
        start_shared_env_build
      fi
      ;;
    compute)
      configure_neuron_apt_repo
      install_compute_packages
      if [[ "${ARG_SKIP_HOSTS_FIX}" == 1 ]]; then
        log "skipping the ${HOSTS_FILE} fix (--skip-hosts-fix)"
      else
        fix_etc_hosts "$(hostname -s)" "$(hostname)"
      fi
      reserve_rendezvous_ports
      check_devices
      check_shared_env_visible
      install_monitoring_units neuron
      record_bootstrap_end
      ;;
    cpu)
      log "CPU node: no Neuron devices, nothing to install (it uses the shared venv)"
      check_shared_env_visible
      ;;
    login)
      log "login node: nothing to install (it uses the shared venv)"
      ;;
  esac
  log "done in ${SECONDS}s"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
