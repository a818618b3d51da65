# Sourced by the GPU scripts: cudarc loads libcuda, libnvrtc and libcublas by name, so put the
# toolkit's and the pip wheels' on the library path.
extra=$(find /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib "$(python3 -c 'import nvidia,os;print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null)/nvidia" \
    -maxdepth 3 \( -name 'libcublas.so*' -o -name 'libnvrtc.so*' \) -printf '%h\n' 2>/dev/null | grep -v stubs | sort -u | paste -sd:)
export LD_LIBRARY_PATH=${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
