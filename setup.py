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
    python_requires=">=3.10",
    packages=find_packages(include=["oscar_vllm", "oscar_vllm.*", "csrc_triton", "csrc_triton.*"]),
    install_requires=[
        "vllm==0.26.0",  # pins torch 2.11 and triton 3.6
        "torch",
        "triton",
        "transformers>=5.5",
        "safetensors",
        "huggingface_hub",
        "gguf>=0.19",
        "accelerate",
        "tqdm",
        "matplotlib",
    ],
    extras_require={"test": ["pytest"]},
    entry_points={
        "console_scripts": [
            "oscar-calibrate=oscar_vllm.calibrate:main",
            "oscar-evaluate=oscar_vllm.evaluate:main",
            "oscar-rotations=oscar_vllm.rotation_io:main",
            "oscar-vllm=oscar_vllm.serve:main",
        ],
        # vLLM loads these in every process; register() makes --attention-backend OSCAR work.
        "vllm.general_plugins": ["oscar = oscar_vllm.plugin:register"],
    },
)
