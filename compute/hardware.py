"""
Hardware policy: what this machine can run fast, decided in one place, outside the model.

    auto_dtype(device_type)     what dtype='auto' trains in, and why (bf16 where the hardware has it)
    cpu_bf16_units()            the CPU's native bf16 matrix instructions, or None
    peak_flops(device_name)     a GPU's bf16 datasheet peak, for MFU
    peak_bandwidth(device_name) a GPU's datasheet memory bandwidth, for decoding's bandwidth utilization
    attention_path(...)         the attention kernel attn_impl='auto' stands for
    flush_denormals()           fp32 values below 2^-126 count as zero on this CPU (much faster)

Every choice here changes speed only, never the model's result (the tests check that every attention path
computes the same thing).
"""
import torch


# the longest key length at which explicit attention beat the CPU flash kernel in bf16 (measured forward +
# backward on an AVX-512 BF16 EPYC, head sizes 32 and 64: explicit 1.2-5.3x faster at T = 64..512, flash
# 1.25-1.7x faster at T = 1024)
EXPLICIT_MAX_T = 512


def attention_path(impl, device_type, dtype, Tk):
    """The attention kernel 'auto' stands for, picked by measurement (docs/performance.md, "Attention on a
    CPU"): the flash kernel of F.scaled_dot_product_attention wherever it won (GPUs; fp32 on CPUs: level at
    T = 64, up to 3x ahead at T = 1024), explicit attention for bf16/fp16 on CPUs up to EXPLICIT_MAX_T keys,
    where the CPU flash kernel loses. fp16 on CPUs is not measured and follows bf16."""
    if impl != 'auto':
        return impl
    low = dtype in (torch.bfloat16, torch.float16)
    return 'explicit' if device_type == 'cpu' and low and Tk <= EXPLICIT_MAX_T else 'sdpa'


# bf16 dense peak FLOP/s by device name (datasheet numbers, no sparsity), for MFU
PEAK_FLOPS = {'H200': 989e12, 'H100': 989e12, 'A100': 312e12, 'L40S': 362e12, 'L4': 121e12,
              'A10': 125e12, 'RTX 4090': 165e12, 'RTX 3090': 71e12, 'V100': 125e12, 'T4': 65e12}


def peak_flops(device_name):
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in str(device_name).lower():
            return flops
    return None


# memory bandwidth in bytes/s by device name (datasheet; the first name that matches), for the bandwidth
# utilization of decoding at batch 1, which reads every weight once a token and does little else
PEAK_BANDWIDTH = {'H200': 4.8e12, 'H100 PCIe': 2.0e12, 'H100': 3.35e12, 'A100-SXM4-80GB': 2.04e12,
                  'A100': 1.56e12, 'L40S': 0.864e12, 'L4': 0.3e12, 'A10': 0.6e12, 'RTX 4090': 1.008e12,
                  'RTX 3090': 0.936e12, 'V100': 0.9e12, 'T4': 0.32e12}


def peak_bandwidth(device_name):
    return next((bw for name, bw in PEAK_BANDWIDTH.items() if name.lower() in str(device_name).lower()), None)


def cpu_bf16_units():
    """The CPU's native bf16 matrix instructions ('AMX-BF16' or 'AVX512-BF16'), or None. Without them bf16
    matmuls on a CPU are emulated (converted to fp32), and bf16 autocast buys little or nothing."""
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            flags = next((line.split(':', 1)[1].split() for line in cpuinfo if line.startswith('flags')), [])
    except OSError:
        flags = []
    probe = lambda name: getattr(torch.cpu, name, lambda: False)()  # private PyTorch checks, where present
    if 'amx_bf16' in flags or probe('_is_amx_tile_supported'):
        return 'AMX-BF16'
    if 'avx512_bf16' in flags or probe('_is_avx512_bf16_supported'):
        return 'AVX512-BF16'
    return None


def auto_dtype(device_type):
    """What dtype='auto' trains in, with the reason: bf16 autocast on GPUs that have it (else fp16), and on
    CPUs with bf16 units, where the default step measured 1.4-1.7x faster than fp32 (1 or 2 threads) and
    the laptop blind-spot arms kept their CE and norms (docs/performance.md, "bf16 on a CPU"); fp32
    elsewhere."""
    if device_type == 'cuda':
        return ('bfloat16', 'the GPU has bf16') if torch.cuda.is_bf16_supported() else \
            ('float16', 'the GPU lacks bf16')
    units = cpu_bf16_units() if device_type == 'cpu' else None
    if units:
        return 'bfloat16', f'the CPU has {units}'
    return 'float32', 'no bf16 units on this CPU' if device_type == 'cpu' else f'fp32 on {device_type}'


def flush_denormals():
    """Count fp32 values below 2^-126 (denormals) as zero in this process's CPU arithmetic. The
    softmax of an early exit underflows into them, and a matmul over denormals runs ~20x slower on
    Intel CPUs: measured, one per-loop training step at GPT-2's vocabulary took 60 s instead of
    2.6 s, with the same loss. Call it before the first parallel op, so torch's threads inherit it."""
    torch.set_flush_denormal(True)

