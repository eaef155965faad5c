"""`rosetta gpu` / `make gpu`: the plan of the job, the device facts it records, its refusal
without a GPU, and the whole job run end to end on the CPU (`--device cpu`, reduced)."""

from __future__ import annotations

import json

import pytest

from conformance.machine import NVIDIA_DRIVER, driver_version
from rosetta.gpu import folder_name, plan_steps
from rosetta.main import main


def test_the_default_plan(tmp_path):
    steps = plan_steps(tmp_path, "cuda")
    assert [s.name for s in steps] == ["check-tiny", "check-char-lm", "check-llama-tiny", "check-qwen2-tiny",
                                       "check-qwen3-tiny", "check-mixtral-tiny", "check-qwen3-moe-tiny", "probe",
                                       "bench"]
    check = steps[0].argv
    assert "--backward" in check and "--jobs" not in check  # the gradient and training cells too; the check's own jobs
    assert check[check.index("--backends") + 1] == "torch,torch-math,jax,jax-math,onnx,onnx-jax"
    assert check[check.index("--devices") + 1] == "cuda" and "--dtypes" not in check  # every dtype each runs
    bench = steps[-1].argv
    assert bench[bench.index("--preset") + 1] == "paper-base" and bench[bench.index("--devices") + 1] == "cuda"
    contenders = bench[bench.index("--contenders") + 1].split(",")
    assert contenders[0] == "torch-cuda-float16"
    assert {"onnxruntime-cuda-float32", "onnxruntime-cuda-float16", "jax-cuda-float16",
            "torch.compile-reduce-overhead-cuda-float16", "torch.compile-cuda-float16"} <= set(contenders)
    assert all("-cuda-" in c for c in contenders)
    steps = plan_steps(tmp_path, "cuda", presets=("tiny",), bench_preset=None, backward=False, jobs=8)
    assert [s.name for s in steps] == ["check-tiny", "probe"]
    assert "--backward" not in steps[0].argv and steps[0].argv[steps[0].argv.index("--jobs") + 1] == "8"


@pytest.mark.parametrize("text, version", [
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U22)  Thu Sep 4 2025",
     "580.95.05"),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023", "535.104.05"),
    ("something else entirely", None),
])
def test_driver_version(text, version):
    assert driver_version(text) == version


def test_folder_names():
    assert folder_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert folder_name("NVIDIA H200") == "nvidia-h200"
    assert folder_name("x86_64") == "x86-64" and folder_name("///") == "device"


@pytest.mark.skipif(NVIDIA_DRIVER.exists(), reason="checks the refusal on a machine without an NVIDIA driver")
def test_refused_without_a_gpu(tmp_path, capsys):
    assert main(["gpu", "--out", str(tmp_path)]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_job_end_to_end_on_the_cpu(tmp_path, capsys):
    argv = ["gpu", "--device", "cpu", "--out", str(tmp_path), "--presets", "tiny", "--backends", "torch", "--forward-only",
            "--bench-preset", "tiny", "--bench-contenders", "torch,onnxruntime-cpu-float32"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    (folder,) = tmp_path.iterdir()
    record = json.loads((folder / "environment.json").read_text())
    assert record["device"] == "cpu" and record["command"] == ["rosetta", *argv]
    assert record["versions"]["torch"] and record["versions"]["onnxruntime-gpu"]
    assert [(s["name"], s["exit_code"]) for s in record["steps"]] == [("check-tiny", 0), ("probe", 0), ("bench", 0)]
    assert record["steps"][0]["argv"][:2] == ["rosetta", "check"] and " passed, 0 failed" in record["steps"][0]["headline"]
    for written in ("check-tiny/report.json", "check-tiny/heatmap.png", "probe.md", "bench/bench.json", "summary.md",
                    "check-tiny.log"):
        assert (folder / written).is_file(), written
    report = json.loads((folder / "check-tiny/report.json").read_text())
    assert {cell["backend"] for cell in report["cells"]} == {"torch"}
    assert "| check-tiny | 0 |" in printed and printed == (folder / "summary.md").read_text().split("\n\n", 1)[1] + \
        f"\nwritten: {folder}\n"


def test_onnxruntime_gpus_version_without_its_metadata(tmp_path, monkeypatch):
    """On a GPU machine onnxruntime-gpu is staged as its package folder alone (no metadata), beside
    the image's CPU onnxruntime: the version recorded is the one of the module that imports."""
    from importlib import metadata

    from conformance import machine

    package = tmp_path / "staged_runtime"
    package.mkdir()
    (package / "__init__.py").write_text('"""staged"""\n__version__ = "9.8.7"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert machine.module_version("staged_runtime") == "9.8.7"
    assert machine.module_version("no_such_module_here") is None

    real = metadata.version

    def without_gpu_metadata(name):
        if name == "onnxruntime-gpu":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(machine.metadata, "version", without_gpu_metadata)
    monkeypatch.setattr(machine, "module_version", lambda module: {"onnxruntime": "1.31.1"}.get(module))
    assert machine.framework_versions()["onnxruntime-gpu"] == "1.31.1"
