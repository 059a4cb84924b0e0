"""pipeline/errors.py's helpers for untrusted text and paths: shown (one string as it may be printed) and
path_argument (a command-line path the system can look up), issue 68 items 3 and 4."""
import pytest

from pipeline.errors import NAME_MAX, PATH_MAX, UserError, path_argument, shown


def test_shown_escapes_every_unprintable_character_and_caps_the_length():
    assert shown("recipe\x1b[2J\nname\r\t\u2028\ud800 é") == "recipe\\x1b[2J\\nname\\r\\t\\u2028\\ud800 é"
    assert shown("a" * 250) == "a" * 200 + "... (250 characters)"
    assert shown("a" * 250, 300) == "a" * 250
    assert shown(None) == "None" and shown(12) == "12"


@pytest.mark.parametrize("value,says", [
    ("p" * 5000, f"File name too long: 5000 bytes, the longest component 5000; this system looks up at most "
                 f"{PATH_MAX - 1} bytes, {NAME_MAX} per component"),
    ("p/" * 2500, "File name too long: 5000 bytes, the longest component 1"),
    ("q" * (NAME_MAX + 1), f"File name too long: {NAME_MAX + 1} bytes, the longest component {NAME_MAX + 1}"),
    ("a\x00b", "a\\x00b holds a NUL character; allowed a path"),
])
def test_a_path_the_system_cannot_look_up_is_refused_naming_it(value, says):
    with pytest.raises(UserError, match="^ARTIFACT: ") as refused:
        path_argument(value, "ARTIFACT")
    assert says in str(refused.value) and "\n" not in str(refused.value) and len(str(refused.value)) < 600


def test_a_path_that_merely_does_not_exist_passes(tmp_path):
    assert path_argument(str(tmp_path / "missing" / "x"), "OUT") == tmp_path / "missing" / "x"
    (tmp_path / "file").write_text("x")
    assert path_argument(str(tmp_path / "file" / "below"), "OUT") == tmp_path / "file" / "below"  # ENOTDIR
    assert path_argument(str(tmp_path), "OUT").is_dir()
