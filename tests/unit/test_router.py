from areal.controller.router import Router


def test_least_loaded_alive_server_unless_the_preferred_one_is_alive():
    router = Router(3)
    router.load[:] = [2, 0, 1]
    assert router.pick() == 1
    assert router.pick(preferred=0) == 0  # a group stays where it started
    router.mark_dead(1)
    assert router.pick() == 2
    router.mark_dead(0)
    assert router.pick(preferred=0) == 2  # its server is dead: the least loaded alive one
    router.mark_dead(2)
    assert not router.any_alive()
    router.mark_alive(0, version=7)
    assert router.pick(preferred=2) == 0 and router.version[0] == 7
