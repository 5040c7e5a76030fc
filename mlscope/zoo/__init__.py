"""The built-in model zoo: real models built offline with fixed seeds.

``mlscope zoo build`` runs the builders in :mod:`mlscope.zoo.build`. Builders import
their frameworks lazily. A build repeats its bytes on one machine only (training and
constant folding round differently on other CPUs), so the committed manifests pin the
build's inputs and each model's behaviour (accuracy, probe outputs, with tolerances),
and each build records the bytes it made in its lock file (``mlscope.lock``), which
agents verify and every evaluation carries.
"""
