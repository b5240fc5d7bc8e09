"""The one place the scripts name the CPU they ran on: ``cpu_name()`` for the text of results
("AMD EPYC (family 25, model 17, x86_64, AVX-512, 2 logical CPUs)": the name alone can be as
vague as "AMD EPYC"), ``cpu_key()`` for the file names of per-CPU results (amd_zen4,
intel_skylakex, ...) and ``host_isa()`` for the widest vector extension the host has."""
import os
import platform

# AMD families 23, 25 and 26 by model range; Intel family 6 server and client cores by model.
AMD_CORES = {23: [(0x00, "zen"), (0x30, "zen2")],
             25: [(0x00, "zen3"), (0x10, "zen4"), (0x20, "zen3"), (0x60, "zen4"),
                  (0x70, "zen4"), (0xa0, "zen4")],
             26: [(0x00, "zen5")]}
INTEL_CORES = {0x3f: "haswell", 0x4f: "broadwell", 0x55: "skylakex", 0x6a: "icelake",
               0x6c: "icelake", 0x8f: "sapphirerapids", 0xcf: "emeraldrapids",
               0xad: "graniterapids", 0x9e: "kabylake", 0xa5: "cometlake", 0x97: "alderlake",
               0xb7: "raptorlake"}


def _fields(cpuinfo="/proc/cpuinfo"):
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def host_isa(cpuinfo="/proc/cpuinfo"):
    """The best of AVX-512, AVX2 the host has, from its feature flags."""
    flags = set(_fields(cpuinfo).get("flags", "").split())
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"


def cpu_name(cpuinfo="/proc/cpuinfo"):
    """The CPU's model name with its family, model, widest vector extension and logical CPUs."""
    fields = _fields(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    facts = [f"family {fields['cpu family']}, model {fields['model']}"
             if "cpu family" in fields and "model" in fields else None,
             platform.machine() or None, host_isa(cpuinfo) if fields else None,
             f"{os.cpu_count()} logical CPUs"]
    return f"{name} ({', '.join(f for f in facts if f)})"


def cpu_key(cpuinfo="/proc/cpuinfo"):
    """<vendor>_<family>: amd_zen4, intel_skylakex, ... (the CPU's family and model numbers
    where the model is not listed), naming the results files of each CPU met."""
    fields = _fields(cpuinfo)
    if not fields:
        return platform.machine().lower() or "unknown"
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(fields.get("vendor_id"),
                                                                 fields.get("vendor_id",
                                                                            "cpu").lower())
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return f"{vendor}_{platform.machine().lower()}"
    name = None
    if vendor == "amd" and family in AMD_CORES:
        name = [core for start, core in AMD_CORES[family] if model >= start][-1]
    elif vendor == "intel" and family == 6:
        name = INTEL_CORES.get(model)
    return f"{vendor}_{name or f'f{family}m{model}'}"


def build_isa(vector_bytes):
    """The instruction set kernels were built for, from their vector width."""
    return {64: "AVX-512", 32: "AVX2", 16: "SSE"}.get(vector_bytes, f"{vector_bytes}-byte")


def isa_suffix(isa, cpuinfo="/proc/cpuinfo"):
    """A results file's name suffix for kernels built for `isa`: none for the host's own."""
    return "" if isa == host_isa(cpuinfo) else "_" + isa.lower().replace("-", "")
