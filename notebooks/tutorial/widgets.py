"""Figures as PNG outputs, and ipywidgets controls that redraw them in place.

Only the notebooks' display layer: a figure for the default values is an ordinary image output
(so a notebook executed headless, on CI or for the docs site, has its figures), and moving a
control in JupyterLab re-runs the function and replaces the image.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Callable
from typing import Any

__all__ = ["figure_png", "live", "show"]


def figure_png(fig: Any, dpi: int = 90) -> bytes:
    """PNG bytes of a figure, without the software tag (so re-executing does not churn)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def _renderable(result: Any) -> Any:
    from IPython.display import Image, Pretty

    if hasattr(result, "savefig"):
        return Image(data=figure_png(result), format="png")
    if isinstance(result, str):
        return Pretty(result)
    return result


def show(result: Any) -> None:
    """Display a figure as a PNG image output (anything else is displayed as it is)."""
    from IPython.display import display

    display(_renderable(result))


def live(fn: Callable[..., Any], /, **controls: Any) -> None:
    """Show ``fn(**defaults)`` now as an ordinary output, with widgets that redraw it in place.

    ``controls`` are ipywidgets ``interact`` abbreviations (``(1, 8)`` a slider, a list a
    dropdown, a bool a checkbox) or widgets; a control's initial value is ``fn``'s default for
    that argument. The first figure is a plain image output; in JupyterLab moving a control
    re-runs ``fn`` and replaces the image (``display_id`` update). An invalid combination shows
    the error text instead.
    """
    import ipywidgets as widgets
    from IPython.display import display

    sig = inspect.signature(fn)
    made = {}
    for name, abbrev in controls.items():
        if name not in sig.parameters:
            raise ValueError(f"{fn.__name__} has no argument {name!r}")
        default = sig.parameters[name].default
        if isinstance(abbrev, widgets.Widget):
            w = abbrev
        else:
            kw = {} if default is inspect.Parameter.empty else {"default": default}
            w = widgets.interactive.widget_from_abbrev(abbrev, **kw)
            if w is None:
                raise ValueError(f"cannot make a widget for {name}={abbrev!r}")
        w.description = name
        w.style = {"description_width": "initial"}
        made[name] = w
    box = widgets.HBox(list(made.values()), layout=widgets.Layout(flex_flow="row wrap"))
    bundle = box._repr_mimebundle_()
    bundle["text/plain"] = (
        f"[interactive controls for {fn.__name__} ({', '.join(made)}): run this cell in "
        f"JupyterLab to use them]"
    )
    display(bundle, raw=True)

    def render() -> Any:
        try:
            return _renderable(fn(**{k: w.value for k, w in made.items()}))
        except (ValueError, ZeroDivisionError) as e:
            return _renderable(f"{type(e).__name__}: {e}")

    handle = display(render(), display_id=True)

    def update(_change: Any = None) -> None:
        handle.update(render())

    for w in made.values():
        w.observe(update, names="value")
