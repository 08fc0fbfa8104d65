"""Where an installed petctl carries its templates: `petctl/_templates/cfn/*.j2` and
`petctl/_templates/worker_image/*.j2`.

Nothing is copied by hand: setup.py maps the top-level `cfn/` and `worker_image/` directories (the source
of truth) onto the packages `petctl._templates.cfn` and `petctl._templates.worker_image`, and ships their
`*.j2` files as package data. A checkout (or an editable install) reads the top-level directories
directly; see `petctl.providers.aws.templates.resource_dir`.
"""
