"""What pyproject.toml cannot say: the wheel installs `_caffepar_caffe.pth` beside the packages,
so that `import caffe` finds caffepar at once after `pip install` (see _caffepar_caffe.py)."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "_caffepar_caffe.pth"
# Quiet when the module is gone (an editable install whose checkout lost it): a .pth line that
# fails prints a traceback at every interpreter start.
PTH_LINE = ("import importlib.util; importlib.util.find_spec('_caffepar_caffe') and "
            "__import__('_caffepar_caffe').install()\n")


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        # An editable wheel is made of the install folder, not of build_lib.
        folder = self.get_finalized_command("install").install_lib \
            if getattr(self, "editable_mode", False) else self.build_lib
        self.mkpath(folder)
        with open(os.path.join(folder, PTH_NAME), "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_NAME)]


setup(cmdclass={"build_py": BuildPyWithPth})
