"""Every scenario, one module each, declared by its traits (:mod:`mlscope.scenario_traits`).

Each module here registers its scenarios when imported; :mod:`mlscope.scenario_traits`
imports every module of this package the first time a name is asked for. Adding a
scenario whose load is one run (an open loop on its own arrivals, or a closed loop) is
one new module here plus its test; the server runs it with its generic strategy and the
agent can run it locally. A scenario of several runs also declares its server strategy
in ``broker/scenario_kinds`` (see :mod:`.batched`, :mod:`.peak`, :mod:`.cold_start`).
"""
