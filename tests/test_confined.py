"""`confined.inside`: a name a file gives stays in its directory, links resolved."""

import os

import pytest

from armor_megatron.confined import PathEscapeError, inside
from armor_megatron.errors import UserInputError


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "link/x", "", "a\0b"])
def test_names_leaving_the_directory_are_refused(tmp_path, name):
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path, tmp_path / "d" / "link")
    with pytest.raises(PathEscapeError) as err:
        inside(tmp_path / "d", name, "index.json")
    assert isinstance(err.value, UserInputError) and str(err.value).startswith("index.json: names ")


@pytest.mark.parametrize("name", ["x", "sub/x", "sub/../x", "inner/x"])
def test_names_inside_are_joined_as_given(tmp_path, name):
    (tmp_path / "sub").mkdir()
    os.symlink(tmp_path / "sub", tmp_path / "inner")  # a link that stays inside
    assert inside(str(tmp_path), name, "index.json") == os.path.join(str(tmp_path), name)
