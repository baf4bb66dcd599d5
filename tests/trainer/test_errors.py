"""trainer/errors.py: which OSErrors name a path the user gave (then the user's to fix, one line)."""

from types import SimpleNamespace

from trainer.errors import names_a_user_path


def flags(**given):
    defaults = dict(data_path="", eval_data_path=None, tokenizer_path=None, save_dir="/runs/a", resume_from=None,
                    cache_dir=None, from_weight="none")
    return SimpleNamespace(**{**defaults, **given})


def error_at(path: str) -> OSError:
    return OSError(28, "No space left on device", path)


def test_a_path_inside_a_folder_the_user_named_is_the_users():
    args = flags(data_path="/data/shards:2,/data/chat.jsonl")  # a weighted source: its path without ':2'
    assert names_a_user_path(error_at("/runs/a/checkpoints/step_1.pt"), args)
    assert names_a_user_path(error_at("/data/.cache/tokens.bin"), args)  # the cache goes next to the data
    assert not names_a_user_path(error_at("/usr/lib/python3/x.py"), args)
    assert not names_a_user_path(OSError(5, "Input/output error"), args)  # no file named: a bug of ours


def test_with_a_cache_dir_the_datas_folder_is_not_the_users_to_write():
    args = flags(data_path="/data/shards:2", cache_dir="/cache")
    assert names_a_user_path(error_at("/cache/tokens.bin"), args)
    assert names_a_user_path(error_at("/data/shards/part-0.jsonl"), args)
    assert not names_a_user_path(error_at("/data/.cache/tokens.bin"), args)
