"""The notebook's side: the magics (parse the line, call the API, display), how RRefs look,
the JupyterLab panel's comm, and the widgets. Nothing below imports it.
"""
