"""An installed wheel, without this checkout, has the bundled policies (``conf/`` ships inside the package)."""

import subprocess
import sys
import zipfile
from pathlib import Path

from compile_trainer.schema import bundled_policy_names

ROOT = Path(__file__).resolve().parents[1]


def test_a_wheel_installed_away_from_the_checkout_finds_the_bundled_policies(tmp_path):
    build = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q"]
    subprocess.run([*build, "-w", str(tmp_path)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("compile_trainer-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = (
        "import compile_trainer.schema as p; from compile_trainer import to_policy;"
        "print(p.bundled_policy_dir()); print(','.join(p.bundled_policy_names()));"
        "print(to_policy('regional').mode)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env={"PYTHONPATH": str(site)}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    where, names, mode = out.stdout.split()
    assert Path(where).is_relative_to(site), "the policies come from the installed package, not the checkout"
    assert names.split(",") == bundled_policy_names()
    assert mode == "reduce-overhead"
