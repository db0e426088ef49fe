"""The built-in tasks' graders, beside the tasks that use them (a package, so never a task):

    math.py     the last \\boxed{} against the gold answer: a screen, then math-verify
                (tasks/math.py; sympy, imported by the reward service before its pool forks)
    code.py     the last ```python block against unit tests, each run by sandbox.py
    sandbox.py  one untrusted program under limits (bwrap, rlimits, its own uid and session)

They import nothing of areal's but each other: the reward service (areal/reward/) imports
the tasks and the sandbox, never the other way round.
"""
