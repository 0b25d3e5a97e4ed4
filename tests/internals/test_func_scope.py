"""ftrain.internals.func_scope: a per-thread flag, set only inside entered()."""

import threading

from ftrain.internals import func_scope


def test_set_inside_the_block_only_and_per_thread():
    seen = {}

    def other_thread():
        seen["other"] = func_scope.inside()

    assert not func_scope.inside()
    with func_scope.entered():
        assert func_scope.inside()
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert not func_scope.inside()
    assert seen["other"] is False  # another thread does not see this one's scope
