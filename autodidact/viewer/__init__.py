"""``autodidact view``: a read-only web page over run directories (docs/viewer.md).

:mod:`autodidact.viewer.groups` indexes a replay store's groups for paged, filtered lists;
:mod:`autodidact.viewer.data` answers each view from a run directory;
:mod:`autodidact.viewer.server` serves both and the page in ``static/``.
"""
