"""Network: one Trainium availability zone, private compute, no inbound access from the internet."""

from __future__ import annotations

from aws_cdk import CfnResource, Stack
from aws_cdk import aws_ec2 as ec2
from constructs import Construct

from stacks.log_groups import log_group_with_retention


class Network(Construct):
    """VPC with one public (NAT only) and one private subnet in the configured zone, plus the cluster group.

    EFA needs every node in one subnet and one zone, so the VPC has exactly one of each subnet kind.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        vpc_cidr: str,
        availability_zone: str,
        zone_is_id: bool,
        log_retention_days: int,
    ) -> None:
        super().__init__(scope, construct_id)
        self.vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(vpc_cidr),
            availability_zones=[availability_zone],
            nat_gateways=1,
            subnet_configuration=[
                ec2.SubnetConfiguration(name="public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=24),
                ec2.SubnetConfiguration(name="private", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=18),
            ],
            gateway_endpoints={"S3": ec2.GatewayVpcEndpointOptions(service=ec2.GatewayVpcEndpointAwsService.S3)},
        )
        flow_log_group = log_group_with_retention(self, "FlowLogs", log_retention_days)
        self.vpc.add_flow_log(
            "FlowLog",
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group),
            traffic_type=ec2.FlowLogTrafficType.REJECT,
        )
        if zone_is_id:
            # A zone ID names the same physical zone in every account (Capacity Blocks and reservations are
            # sold by zone ID); CDK places subnets by zone name, so the subnets are given the ID instead.
            for subnet in (*self.vpc.public_subnets, *self.vpc.private_subnets):
                cfn_subnet = subnet.node.default_child
                assert isinstance(cfn_subnet, ec2.CfnSubnet)
                cfn_subnet.add_property_deletion_override("AvailabilityZone")
                cfn_subnet.add_property_override("AvailabilityZoneId", availability_zone)
        self.private_subnet = self.vpc.private_subnets[0]
        handler = _default_group_handler(Stack.of(self))
        if handler is not None:
            # CDK's handler that empties the default security group: its logs go to a group of this stack
            # (the one Lambda would create outlives the stack), and it carries one scoped cfn-lint exception.
            handler_logs = log_group_with_retention(self, "DefaultGroupHandlerLogs", log_retention_days)
            handler.add_property_override("LoggingConfig", {"LogGroup": handler_logs.log_group_name})
            handler.add_metadata("cfn-lint", {"config": {"ignore_checks": ["W3005"]}})

        self.cluster_security_group = ec2.SecurityGroup(
            self,
            "ClusterSecurityGroup",
            vpc=self.vpc,
            description="Head and compute nodes: all traffic among themselves (Slurm, EFA), outbound via NAT",
            allow_all_outbound=True,
        )
        group = self.cluster_security_group
        group.add_ingress_rule(group, ec2.Port.all_traffic(), "All traffic between cluster nodes (EFA, Slurm)")
        # EFA also needs an outbound rule to the group itself: its SRD traffic matches no 0.0.0.0/0 rule, and
        # ParallelCluster's EFA validator rejects the cluster without it. CDK drops egress rules added to a
        # group that allows all outbound traffic, so this one is its own resource.
        ec2.CfnSecurityGroupEgress(
            self,
            "ClusterSelfEgress",
            group_id=group.security_group_id,
            ip_protocol="-1",
            destination_security_group_id=group.security_group_id,
            description="All traffic between cluster nodes (EFA needs it both ways)",
        )


def _default_group_handler(stack: Stack) -> CfnResource | None:
    """The Lambda CDK generates for `restrictDefaultSecurityGroup` (one per stack).

    CDK writes both `DependsOn` and `Fn::GetAtt` from it to its role; cfn-lint's W3005 flags the redundancy.
    It is harmless and not ours to change, so only that resource ignores only that rule.
    """
    provider = stack.node.try_find_child("Custom::VpcRestrictDefaultSGCustomResourceProvider")
    handler = provider.node.try_find_child("Handler") if provider else None
    return handler if isinstance(handler, CfnResource) else None
