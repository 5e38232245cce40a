"""The compiled parts (the kernels, runtime/_qdot.c and runtime/_ggml.c; the SIGBUS message, formats/_mapguard.c) and the files a wheel must carry besides the
code: the bundled models, the checksum manifests and the held-out text, copied into
kimistream/formats/bundled/ (found there by formats/bundled_data.py). Everything else is in
pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

BUNDLED = ("models", "checksums", "data")


class BuildWithData(build_py):
    def run(self):
        super().run()
        dest = Path(self.build_lib) / "kimistream" / "formats" / "bundled"
        for name in BUNDLED:
            if Path(name).is_dir():
                shutil.copytree(name, dest / name, dirs_exist_ok=True)


setup(
    cmdclass={"build_py": BuildWithData},
    ext_modules=[
        Extension("kimistream.runtime._qdot", ["runtime/_qdot.c", "runtime/_ggml.c"],
                  extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-ffp-contract=off"]),
        Extension("kimistream.formats._mapguard", ["formats/_mapguard.c"], extra_compile_args=["-std=gnu11"]),
    ],
)
