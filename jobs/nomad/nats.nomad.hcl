# NATS with JetStream for SilentSwarm: the control plane, the relay and the durable state.
# One server by default; `nomad job run -var nats_servers=3 nats.nomad.hcl` runs a 3-node
# cluster (one per client, routes found through Nomad's service discovery).

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "nats_servers" {
  type    = number
  default = 1
}

job "swarm-nats" {
  datacenters = var.datacenters
  type        = "service"

  group "nats" {
    count = var.nats_servers

    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    network {
      port "client" {
        static = 4222
      }
      port "cluster" {
        static = 6222
      }
      port "monitor" {
        static = 8222
      }
    }

    # JetStream's store must outlive allocations: a host volume named "swarm-nats" on each
    # client, at /var/lib/swarm-nats (client { host_volume "swarm-nats" { path =
    # "/var/lib/swarm-nats" } }). raw_exec does not mount volumes: the volume reserves the
    # path (and pins the job to clients that have it) and the task uses it in place.
    volume "store" {
      type      = "host"
      source    = "swarm-nats"
      read_only = false
    }

    service {
      name     = "swarm-nats"
      port     = "client"
      provider = "nomad"

      check {
        type     = "http"
        port     = "monitor"
        path     = "/healthz?js-enabled-only=true"
        interval = "10s"
        timeout  = "2s"
      }
    }

    service {
      name     = "swarm-nats-cluster"
      port     = "cluster"
      provider = "nomad"
    }

    restart {
      attempts = 10
      interval = "30m"
      delay    = "10s"
      mode     = "delay"
    }

    task "nats" {
      driver = "raw_exec"

      volume_mount {
        volume      = "store"
        destination = "/var/lib/swarm-nats"
      }

      config {
        command = "/opt/silentswarm/bin/nats-server"
        args = concat(
          [
            "--addr", "0.0.0.0",
            "--port", "${NOMAD_PORT_client}",
            "--http_port", "${NOMAD_PORT_monitor}",
            "--jetstream",
            "--store_dir", "/var/lib/swarm-nats",
            "--server_name", "swarm-nats-${NOMAD_ALLOC_INDEX}",
          ],
          ["--config", "${NOMAD_TASK_DIR}/${var.nats_servers > 1 ? "cluster" : "auth"}.conf"],
        )
      }

      # Who may connect: the swarm's NATS authority (`swarm nats-auth init` writes it), from
      #   nomad var put nomad/jobs/swarm-nats server_conf=@nats-auth/server.conf
      # The task waits until that variable exists: NATS never runs open by accident. (For a
      # throwaway dev cluster put server_conf="" and run the leader with SWARM_DEV=1.)
      template {
        destination = "local/auth.conf"
        change_mode = "restart"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-nats" }}{{ .server_conf }}{{ end }}
        EOT
      }

      # With more than one server: routes to the others, reloaded (SIGHUP) as they come and
      # go. The task starts with the plain flags above and reads this file on reload.
      dynamic "template" {
        for_each = var.nats_servers > 1 ? [1] : []
        content {
          destination   = "local/cluster.conf"
          change_mode   = "signal"
          change_signal = "SIGHUP"
          data          = <<-EOT
          {{- $routes := "" }}{{ range nomadService "swarm-nats-cluster" }}{{ $routes = printf "%s nats-route://%s:%d" $routes .Address .Port }}{{ end }}
          include "auth.conf"
          cluster {
            name: swarm
            listen: 0.0.0.0:6222
            routes: [{{ $routes }} ]
          }
          EOT
        }
      }

      resources {
        cpu    = 500
        memory = 512
      }
    }
  }
}
