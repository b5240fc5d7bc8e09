"""scripts/cpuinfo.py: the one CPU naming the results files and texts use."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import cpuinfo  # noqa: E402


def fake(tmp_path, vendor, family, model, flags="fpu sse2 avx2", name="Some CPU"):
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
                 f"model\t\t: {model}\nmodel name\t: {name}\nflags\t\t: {flags}\n\n"
                 f"processor\t: 1\nvendor_id\t: Other\n")
    return str(p)


def test_cpu_key_by_family_and_model(tmp_path):
    assert cpuinfo.cpu_key(fake(tmp_path, "AuthenticAMD", 25, 17)) == "amd_zen4"
    assert cpuinfo.cpu_key(fake(tmp_path, "AuthenticAMD", 25, 33)) == "amd_zen3"
    assert cpuinfo.cpu_key(fake(tmp_path, "AuthenticAMD", 23, 49)) == "amd_zen2"
    assert cpuinfo.cpu_key(fake(tmp_path, "AuthenticAMD", 26, 2)) == "amd_zen5"
    assert cpuinfo.cpu_key(fake(tmp_path, "GenuineIntel", 6, 0x55)) == "intel_skylakex"
    assert cpuinfo.cpu_key(fake(tmp_path, "GenuineIntel", 6, 0x99)) == "intel_f6m153"
    assert cpuinfo.cpu_key(str(tmp_path / "absent")) != ""


def test_cpu_name_and_isa(tmp_path):
    path = fake(tmp_path, "AuthenticAMD", 25, 17, "fpu avx2 avx512f", "AMD EPYC")
    assert cpuinfo.host_isa(path) == "AVX-512"
    name = cpuinfo.cpu_name(path)
    assert name.startswith("AMD EPYC (family 25, model 17, ") and "AVX-512" in name
    assert cpuinfo.host_isa(fake(tmp_path, "GenuineIntel", 6, 0x3f, "fpu avx2")) == "AVX2"


def test_results_suffix_names_a_foreign_build(tmp_path):
    path = fake(tmp_path, "AuthenticAMD", 25, 17, "fpu avx2 avx512f")
    assert cpuinfo.isa_suffix(cpuinfo.build_isa(64), path) == ""
    assert cpuinfo.isa_suffix(cpuinfo.build_isa(32), path) == "_avx2"
    assert cpuinfo.build_isa(8) == "8-byte"
