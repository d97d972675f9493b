# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engines' page reports (vllm/v1/kv_vmm/page_status.py) and their files
in the engines' directory (vllm/v1/kv_vmm/shm_files.py): the engine's own,
swept by liveness lock when it dies, refused when another user could write
them."""

import os
import shutil
import stat

import pytest

from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
)
from tests.v1.kv_vmm.user_utils import OTHER_UID, ForkedUser
from vllm.v1.kv_vmm import shm_files
from vllm.v1.kv_vmm.page_status import (
    KVPageStatus,
    create_page_status,
    sweep_page_status,
)
from vllm.v1.kv_vmm.shm_files import SharedFileError


def _files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def _report_of_a_child() -> str:
    return create_page_status(4, tag="child").path


def test_page_reports_are_the_engines_own_and_swept_by_lock():
    status = create_page_status(4, tag="t")
    directory = os.path.dirname(status.path)
    st = os.lstat(status.path)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
    # The engines' directory of this user (that of their device ledgers).
    assert directory == shm_files.dir_path(shm_files.file_owner())
    assert os.path.basename(directory) == f"vllm-kv-u{os.geteuid()}"
    # A child's report, a child killed with its report, and names planted by
    # somebody else: a token nobody holds, and no token at all.
    live = ForkedUser(_report_of_a_child)
    dead = ForkedUser(_report_of_a_child)
    live_path, dead_path = live.result(), dead.result()
    dead.kill()
    planted_dead = os.path.join(directory, f"vllm-kv-pages-{'ab' * 16}-x.bin")
    planted_odd = os.path.join(directory, "vllm-kv-pages-notatoken-x.bin")
    for path in (planted_dead, planted_odd):
        with open(path, "w") as f:
            f.write("x")
    try:
        # The next engine's report sweeps by liveness lock, never by name alone.
        create_page_status(4, tag="next").close(unlink=True)
        assert os.path.exists(status.path) and os.path.exists(live_path)
        assert not os.path.exists(dead_path) and not os.path.exists(planted_dead)
        assert os.path.exists(planted_odd)  # not ours to judge
        locks = [n for n in _files(directory) if n.startswith("vllm-kv-proc-")]
        assert len(locks) == 2  # this process's and the live child's
    finally:
        live.kill()
    # A sweep of the directory (the CLI's too) removes a report once its
    # engine died.
    sweep_page_status(directory)
    assert not os.path.exists(live_path)
    # A clean exit removes the process's own files.
    exited = ForkedUser(lambda: [_report_of_a_child(), shm_files._release_at_exit()])
    path, _ = exited.result()
    exited.stop()
    assert not os.path.exists(path)
    status.close(unlink=True)
    assert not os.path.exists(status.path)


def test_a_page_report_others_could_write_is_refused(tmp_path):
    status = create_page_status(4, tag="t")
    status.close()
    os.chmod(status.path, 0o666)
    with pytest.raises(SharedFileError, match="mode 0666") as e:
        KVPageStatus(status.path)
    assert f"KV page report {status.path}" in str(e.value)
    os.chmod(status.path, 0o600)
    target = tmp_path / "report.bin"
    shutil.copy(status.path, target)
    os.unlink(status.path)
    os.symlink(target, status.path)
    with pytest.raises(SharedFileError, match="is a symbolic link"):
        KVPageStatus(status.path)
    os.unlink(status.path)
    if os.geteuid() == 0:
        shutil.copy(target, status.path)
        os.chmod(status.path, 0o600)
        os.chown(status.path, OTHER_UID, OTHER_UID)
        with pytest.raises(SharedFileError, match=f"uid {OTHER_UID}"):
            KVPageStatus(status.path)
        os.unlink(status.path)
