"""petctl on AWS: CloudFormation stacks (cfn/), spot Auto Scaling groups, S3 job prefixes. See docs/aws.md."""
