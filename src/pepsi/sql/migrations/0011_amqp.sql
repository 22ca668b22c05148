-- 0011: the durable AMQP 0-9-1 catalogue and its users (issue 16).
--
-- Everything a RabbitMQ broker keeps in its metadata store lives here, so
-- that it survives restarts and can be read with SQL. Messages themselves
-- stay in pepsi.workqueue: an AMQP queue IS a stage, named by amqp_queue.stage.

-- Virtual hosts. '/' exists from the start, as in RabbitMQ.
CREATE TABLE pepsi.amqp_vhost (
    name    text PRIMARY KEY CHECK (name <> '' AND octet_length(name) <= 255),
    created timestamptz NOT NULL DEFAULT now()
);

-- Users who may log in over AMQP (PLAIN, AMQPLAIN). password_hash is a
-- self-describing scrypt string (pepsi.amqp.passwords), never the password.
CREATE TABLE pepsi.amqp_user (
    name          text PRIMARY KEY CHECK (name <> '' AND octet_length(name) <= 255),
    password_hash text NOT NULL,
    tags          text[] NOT NULL DEFAULT '{}',
    created       timestamptz NOT NULL DEFAULT now(),
    updated       timestamptz NOT NULL DEFAULT now()
);

-- RabbitMQ's permissions: per user and vhost, three regular expressions
-- searched (unanchored) in resource names; '' grants nothing. Having a row at
-- all is what lets the user open the vhost.
CREATE TABLE pepsi.amqp_permission (
    username  text NOT NULL REFERENCES pepsi.amqp_user (name) ON DELETE CASCADE,
    vhost     text NOT NULL REFERENCES pepsi.amqp_vhost (name) ON DELETE CASCADE,
    configure text NOT NULL,
    write     text NOT NULL,
    read      text NOT NULL,
    updated   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (username, vhost)
);
CREATE INDEX amqp_permission_vhost_idx ON pepsi.amqp_permission (vhost);

-- Exchanges. The default exchange is the row named '' (type direct); its
-- bindings (every queue under its own name) are implicit and never stored.
CREATE TABLE pepsi.amqp_exchange (
    vhost       text NOT NULL REFERENCES pepsi.amqp_vhost (name) ON DELETE CASCADE,
    name        text NOT NULL CHECK (octet_length(name) <= 255),
    type        text NOT NULL CHECK (type IN ('direct', 'fanout', 'topic', 'headers')),
    durable     boolean NOT NULL DEFAULT true,
    auto_delete boolean NOT NULL DEFAULT false,
    internal    boolean NOT NULL DEFAULT false,
    arguments   jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(arguments) = 'object'),
    declared_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (vhost, name)
);

-- The name of the stage an AMQP queue is: 'amqp:' VHOST ':' QUEUE, with '%'
-- and ':' of the vhost percent-encoded, so the first ':' after the prefix
-- ends the vhost and no two (vhost, queue) pairs share a stage. pepsi.conf
-- stage names cannot contain ':', so they never collide with these.
CREATE FUNCTION pepsi.amqp_queue_stage(vhost text, queue text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN 'amqp:' || replace(replace(vhost, '%', '%25'), ':', '%3A') || ':' || queue;

-- Queues. A queue is a stage: its messages are the pepsi.workqueue rows whose
-- stage is amqp_queue.stage (generated, hence always consistent).
CREATE TABLE pepsi.amqp_queue (
    vhost       text NOT NULL REFERENCES pepsi.amqp_vhost (name) ON DELETE CASCADE,
    name        text NOT NULL CHECK (name <> '' AND octet_length(name) <= 255),
    stage       text NOT NULL GENERATED ALWAYS AS (pepsi.amqp_queue_stage(vhost, name)) STORED,
    durable     boolean NOT NULL DEFAULT true,
    exclusive   boolean NOT NULL DEFAULT false,
    auto_delete boolean NOT NULL DEFAULT false,
    arguments   jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(arguments) = 'object'),
    declared_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (vhost, name),
    UNIQUE (stage)
);

-- Bindings of a source exchange to a queue or to another exchange. The
-- generated columns carry the foreign keys, so deleting a queue or an
-- exchange (as source or destination) deletes its bindings, as in RabbitMQ.
-- Nothing binds to or from the default exchange.
CREATE TABLE pepsi.amqp_binding (
    vhost            text NOT NULL,
    source           text NOT NULL CHECK (source <> ''),
    destination      text NOT NULL,
    destination_kind text NOT NULL CHECK (destination_kind IN ('queue', 'exchange')),
    routing_key      text NOT NULL DEFAULT '',
    arguments        jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(arguments) = 'object'),
    queue_name       text GENERATED ALWAYS AS
        (CASE WHEN destination_kind = 'queue' THEN destination END) STORED,
    exchange_name    text GENERATED ALWAYS AS
        (CASE WHEN destination_kind = 'exchange' THEN destination END) STORED,
    created          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (vhost, source, destination_kind, destination, routing_key, arguments),
    FOREIGN KEY (vhost, source) REFERENCES pepsi.amqp_exchange (vhost, name) ON DELETE CASCADE,
    FOREIGN KEY (vhost, queue_name) REFERENCES pepsi.amqp_queue (vhost, name) ON DELETE CASCADE,
    FOREIGN KEY (vhost, exchange_name) REFERENCES pepsi.amqp_exchange (vhost, name)
        ON DELETE CASCADE,
    CHECK (destination_kind <> 'exchange' OR destination <> '')
);
CREATE INDEX amqp_binding_queue_idx ON pepsi.amqp_binding (vhost, queue_name)
    WHERE queue_name IS NOT NULL;
CREATE INDEX amqp_binding_exchange_idx ON pepsi.amqp_binding (vhost, exchange_name)
    WHERE exchange_name IS NOT NULL;

-- Every vhost gets RabbitMQ's predeclared exchanges when it is created,
-- whoever creates it (`pepsi amqp vhost add`, the install, plain SQL).
CREATE FUNCTION pepsi.amqp_vhost_predeclare() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pepsi.amqp_exchange (vhost, name, type)
    VALUES (NEW.name, '', 'direct'),
           (NEW.name, 'amq.direct', 'direct'),
           (NEW.name, 'amq.fanout', 'fanout'),
           (NEW.name, 'amq.topic', 'topic'),
           (NEW.name, 'amq.headers', 'headers'),
           (NEW.name, 'amq.match', 'headers');
    RETURN NULL;
END
$$;
CREATE TRIGGER amqp_vhost_predeclare AFTER INSERT ON pepsi.amqp_vhost
    FOR EACH ROW EXECUTE FUNCTION pepsi.amqp_vhost_predeclare();

INSERT INTO pepsi.amqp_vhost (name) VALUES ('/');
