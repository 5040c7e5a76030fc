"""The built-in model zoo: real models built offline, reproducibly, with fixed seeds.

``mlscope zoo build`` runs the builders in :mod:`mlscope.zoo.build`. Builders import
their frameworks lazily.
"""
