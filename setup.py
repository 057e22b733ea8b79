from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec(Path("oscar_vllm/__init__.py").read_text(), version)

setup(
    name="oscar_vllm",
    version=version["__version__"],
    description="2-bit KV cache for vLLM with OSCAR's attention-aware rotations",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10,<3.15",  # vLLM 0.26.0's range
    packages=find_packages(include=["oscar_vllm", "oscar_vllm.*", "csrc_triton", "csrc_triton.*"]),
    install_requires=[
        # What vLLM 0.26.0 pins, stated here too: with a bare "torch" pip first fetched the
        # newest torch and triton (840 MB) and only then backtracked to these.
        "vllm==0.26.0",
        "torch==2.11.0",
        "triton==3.6.0",  # torch 2.11.0's pin
        "nvidia-cutlass-dsl==4.6.0",  # vLLM pins it with the [cu13] extra, which pip resolves apart
        "transformers>=5.5.3",
        # Newer releases of vLLM's unpinned dependencies that its pins rule out, capped so that
        # pip does not download each one to find that out.
        "nvidia-cudnn-frontend<1.29",  # 1.29 needs nvidia-cutlass-dsl>=4.6.2; vLLM pins 4.6.0
        "quack-kernels<0.6.4",  # 0.6.4 pins nvidia-cutlass-dsl 4.6.2
        "xgrammar<0.2.8",  # 0.2.8 needs apache-tvm-ffi>=0.1.11; vLLM pins 0.1.10
        "cuda-bindings<13.5",  # cuda-python 13.4.4, through nvidia-cutlass-dsl, needs ~=13.4.4
        "protobuf<7",  # nvidia-cutlass-dsl 4.6.0 needs <7
        'numpy<2.4; python_version <= "3.12"',  # mistral-common's cap on these Pythons
        "safetensors",
        "huggingface_hub",
        "gguf>=0.19",
        "accelerate",
        "tqdm",
        "matplotlib",
    ],
    extras_require={"test": ["pytest", "ruff==0.17.6"]},  # ruff: .pre-commit-config.yaml's rev; bump them together
    entry_points={
        "console_scripts": [
            "oscar-calibrate=oscar_vllm.calibration.calibrate:main",
            "oscar-evaluate=oscar_vllm.calibration.evaluate:main",
            "oscar-rotations=oscar_vllm.core.rotation_io:main",
            "oscar-vllm=oscar_vllm.serving.serve:main",
        ],
        # vLLM loads these in every process; register() makes --attention-backend OSCAR work.
        "vllm.general_plugins": ["oscar = oscar_vllm.serving.plugin:register"],
    },
)
