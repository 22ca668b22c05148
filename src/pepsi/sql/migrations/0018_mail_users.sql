-- 0018: the users who may log in to the SMTP/LMTP ingress (AUTH PLAIN, LOGIN).
--
-- As pepsi.amqp_user: password_hash is a self-describing scrypt string
-- (pepsi.amqp.passwords), never the password. Managed by `pepsi mail user`.

CREATE TABLE pepsi.mail_user (
    name          text PRIMARY KEY CHECK (name <> '' AND octet_length(name) <= 255),
    password_hash text NOT NULL,
    created       timestamptz NOT NULL DEFAULT now(),
    updated       timestamptz NOT NULL DEFAULT now()
);
