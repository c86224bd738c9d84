"""scripts/_bench_common.py: what every benchmark's JSON records about the CPU it ran on."""

import pathlib

import pytest

from tests.scripts import load_script

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"

# Two processors of a Zen 4 VM's /proc/cpuinfo, trimmed; the second block must not be read.
CPUINFO = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512bw avx512_bf16 sha_ni

processor\t: 1
model name\t: not this one
flags\t\t: amx_tile
"""


@pytest.fixture(scope="module")
def common():
    return load_script("_bench_common")


def test_cpu_info_reads_the_first_processor_and_its_vector_extensions(common, tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert common.cpu_info(str(path)) == {
        "model_name": "AMD EPYC",
        "family": "25",
        "model": "17",
        "isa": ["avx", "avx2", "avx512_bf16", "avx512bw", "avx512f", "f16c", "fma"],
    }


def test_cpu_info_without_proc_cpuinfo_is_empty(common, tmp_path):
    assert common.cpu_info(str(tmp_path / "missing")) == {}


def test_machine_info_records_the_cpu(common):
    info = common.machine_info()
    assert info["backend"] == "cpu" and info["cpu_count"] >= 1
    assert set(info["cpu"]) <= {"model_name", "family", "model", "isa"}
