"""mlscope: distributed deep-learning benchmarking on a message bus.

`import mlscope` is cheap: it loads no framework and no service code. The core
package holds contracts, names, settings, statistics and the bus client; the
services (`agent`, `broker`), `analysis`, `dashboard` and `cli` build on it.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
