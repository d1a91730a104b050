"""Grades fix-shell-script: the backups exist, and the fixed script works on fresh, awkward inputs."""

import os
import subprocess
import tempfile
from pathlib import Path

APP = Path("/app")


def test_backups_of_app_data_exist():
    assert (APP / "backup" / "alpha.txt.bak").read_text() == "alpha\n"
    assert (APP / "backup" / "meeting notes.txt.bak").read_text() == "meeting notes\n"


def test_non_txt_files_not_backed_up():
    assert (APP / "backup").is_dir()
    assert not (APP / "backup" / "table.csv.bak").exists()


def test_script_handles_fresh_folder_with_spaces():
    with tempfile.TemporaryDirectory() as tmp:
        data, backup = Path(tmp, "in put"), Path(tmp, "out dir")
        data.mkdir()
        (data / "a b c.txt").write_text("x\n")
        (data / "plain.txt").write_text("y\n")
        (data / "skip.log").write_text("z\n")
        env = {**os.environ, "DATA_DIR": str(data), "BACKUP_DIR": str(backup)}
        subprocess.run(["bash", str(APP / "backup.sh")], env=env, check=True, capture_output=True, timeout=30)
        assert sorted(p.name for p in backup.iterdir()) == ["a b c.txt.bak", "plain.txt.bak"]
        assert (backup / "a b c.txt.bak").read_text() == "x\n"
